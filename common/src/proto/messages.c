/* messages.c - the list of every message type in proto/tandem.proto, for code that must
 * treat them all alike (the round-trip test, the fuzz target). */
#include "tandem/proto.h"

/* one per line, in the .proto's order */
/* clang-format off */
static const ProtobufCMessageDescriptor *const messages[] = {
    &tandem__v1__frame_header__descriptor,     &tandem__v1__sampling_params__descriptor,
    &tandem__v1__logit_bias__descriptor,       &tandem__v1__bad_word__descriptor,
    &tandem__v1__kv_layout__descriptor,
    &tandem__v1__top_logprob__descriptor,      &tandem__v1__usage__descriptor,
    &tandem__v1__timings__descriptor,          &tandem__v1__chat_message__descriptor,
    &tandem__v1__generate_request__descriptor, &tandem__v1__constraint__descriptor,
    &tandem__v1__error_detail__descriptor,     &tandem__v1__chat_list__descriptor,
    &tandem__v1__token_list__descriptor,       &tandem__v1__generate_chunk__descriptor,
    &tandem__v1__top_logprobs__descriptor,     &tandem__v1__health_request__descriptor,
    &tandem__v1__health_response__descriptor,  &tandem__v1__models_request__descriptor,
    &tandem__v1__model_info__descriptor,       &tandem__v1__models_response__descriptor,
    &tandem__v1__metrics_request__descriptor,  &tandem__v1__metrics_response__descriptor,
    &tandem__v1__metric_label__descriptor,     &tandem__v1__metric_sample__descriptor,
    &tandem__v1__metric_histogram__descriptor, &tandem__v1__metric_family__descriptor,
    &tandem__v1__status_request__descriptor,   &tandem__v1__node_status__descriptor,
    &tandem__v1__cluster_status__descriptor,   &tandem__v1__refused_registration__descriptor,
    &tandem__v1__kv_route__descriptor,         &tandem__v1__register_request__descriptor,
    &tandem__v1__register_ack__descriptor,     &tandem__v1__heartbeat__descriptor,
    &tandem__v1__heartbeat_ack__descriptor,    &tandem__v1__decode_reserve__descriptor,
    &tandem__v1__reserve_ack__descriptor,      &tandem__v1__sequence_spec__descriptor,
    &tandem__v1__prefill_task__descriptor,     &tandem__v1__token_event__descriptor,
    &tandem__v1__finished__descriptor,         &tandem__v1__task_failed__descriptor,
    &tandem__v1__node_cancel__descriptor,      &tandem__v1__kv_transfer__descriptor,
    &tandem__v1__kv_hello__descriptor,         &tandem__v1__kv_hello_ack__descriptor,
    &tandem__v1__node_load__descriptor,        &tandem__v1__kv_shipped__descriptor,
    &tandem__v1__prompt_logprobs_ask__descriptor, &tandem__v1__prompt_logprob__descriptor,
    &tandem__v1__embed_request__descriptor,    &tandem__v1__embedding__descriptor,
    &tandem__v1__embed_response__descriptor,   &tandem__v1__embed_task__descriptor,
    &tandem__v1__embedding_result__descriptor,
};
/* clang-format on */

const ProtobufCMessageDescriptor *const *tdm_proto_messages(size_t *n)
{
    *n = sizeof messages / sizeof messages[0];
    return messages;
}
