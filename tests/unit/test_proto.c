/* test_proto.c - every message of proto/tandem.proto round-trips through pack/unpack with a
 * non-default value in every field (filled through the descriptors, one instance per member
 * of each oneof), the table covers every message the .proto declares, the FrameHeader wire
 * bytes are fixed, and the conversions of common/src/proto/convert.c (sampling parameters
 * with set_mask semantics, KV layout, status codes) behave as proto.h says; the metrics
 * renderer (metrics_text.c) writes the Prometheus text exposition format to the byte. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tdm_test.h"
#include "tandem/proto.h"

static const ProtobufCMessageDescriptor *const *messages;
static size_t n_messages;
#define N_MESSAGES n_messages

/* ---- generic filling and comparison through the descriptors ---- */

static size_t value_size(ProtobufCType t)
{
    switch (t) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32:
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32:
    case PROTOBUF_C_TYPE_ENUM: return 4;
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64: return 8;
    case PROTOBUF_C_TYPE_FLOAT: return sizeof(float);
    case PROTOBUF_C_TYPE_DOUBLE: return sizeof(double);
    case PROTOBUF_C_TYPE_BOOL: return sizeof(protobuf_c_boolean);
    case PROTOBUF_C_TYPE_STRING: return sizeof(char *);
    case PROTOBUF_C_TYPE_BYTES: return sizeof(ProtobufCBinaryData);
    case PROTOBUF_C_TYPE_MESSAGE: return sizeof(ProtobufCMessage *);
    }
    fail_msg("unknown protobuf-c type %d", (int)t);
    return 0;
}

/* An enum's non-zero value (proto3 does not send zero), or 0 when it has no other. */
static int enum_value(const ProtobufCEnumDescriptor *ed, unsigned k)
{
    unsigned nonzero = 0;
    for (unsigned i = 0; i < ed->n_values; i++)
        nonzero += ed->values[i].value != 0;
    if (nonzero == 0)
        return 0;
    unsigned want = k % nonzero;
    for (unsigned i = 0; i < ed->n_values; i++)
        if (ed->values[i].value != 0 && want-- == 0)
            return ed->values[i].value;
    return 0;
}

static void fill_message(ProtobufCMessage *m, unsigned variant);

/* Writes value number k of field fd at p (strings, bytes and submessages from malloc, as
 * protobuf_c_message_free_unpacked expects with the default allocator). */
static void fill_value(const ProtobufCFieldDescriptor *fd, void *p, unsigned k)
{
    unsigned v = fd->id * 10 + k + 1;
    switch (fd->type) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32: *(int32_t *)p = -(int32_t)v * 1009; break;
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32: *(uint32_t *)p = v * 1000003u; break;
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64: *(int64_t *)p = -(int64_t)v * 1000000007LL; break;
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64: *(uint64_t *)p = ((uint64_t)v << 40) | v; break;
    case PROTOBUF_C_TYPE_FLOAT: *(float *)p = (float)v + 0.25f; break;
    case PROTOBUF_C_TYPE_DOUBLE: *(double *)p = (double)v + 0.125; break;
    case PROTOBUF_C_TYPE_BOOL: *(protobuf_c_boolean *)p = 1; break;
    case PROTOBUF_C_TYPE_ENUM: *(int *)p = enum_value(fd->descriptor, k); break;
    case PROTOBUF_C_TYPE_STRING: {
        char buf[128];
        int n = snprintf(buf, sizeof buf, "%s-%u-\xc3\xa9", fd->name, k);
        char *s = malloc((size_t)n + 1);
        assert_non_null(s);
        memcpy(s, buf, (size_t)n + 1);
        *(char **)p = s;
        break;
    }
    case PROTOBUF_C_TYPE_BYTES: {
        ProtobufCBinaryData *b = p;
        b->len = 3 + k;
        b->data = malloc(b->len);
        assert_non_null(b->data);
        for (size_t i = 0; i < b->len; i++)
            b->data[i] = (uint8_t)(v * 7 + i * 13); /* includes 0x00 bytes for some v */
        break;
    }
    case PROTOBUF_C_TYPE_MESSAGE: {
        const ProtobufCMessageDescriptor *sd = fd->descriptor;
        ProtobufCMessage *sub = malloc(sd->sizeof_message);
        assert_non_null(sub);
        sd->message_init(sub);
        fill_message(sub, k);
        *(ProtobufCMessage **)p = sub;
        break;
    }
    }
}

/* Index of the first field of fd's oneof and the number of its members. */
static unsigned oneof_group(const ProtobufCMessageDescriptor *d, unsigned i, unsigned *count)
{
    unsigned first = i;
    while (first > 0 && (d->fields[first - 1].flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
           d->fields[first - 1].quantifier_offset == d->fields[i].quantifier_offset)
        first--;
    unsigned n = 0;
    while (first + n < d->n_fields && (d->fields[first + n].flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
           d->fields[first + n].quantifier_offset == d->fields[i].quantifier_offset)
        n++;
    *count = n;
    return first;
}

/* Instances needed so that every oneof member is set once. */
static unsigned n_variants(const ProtobufCMessageDescriptor *d)
{
    unsigned most = 1;
    for (unsigned i = 0; i < d->n_fields; i++)
        if (d->fields[i].flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
            unsigned n;
            oneof_group(d, i, &n);
            most = n > most ? n : most;
        }
    return most;
}

static void fill_message(ProtobufCMessage *m, unsigned variant)
{
    const ProtobufCMessageDescriptor *d = m->descriptor;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *fd = &d->fields[i];
        char *member = (char *)m + fd->offset;
        if (fd->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
            unsigned n, first = oneof_group(d, i, &n);
            if (i - first != variant % n)
                continue;
            *(uint32_t *)((char *)m + fd->quantifier_offset) = fd->id;
            fill_value(fd, member, variant);
        } else if (fd->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n = 3, sz = value_size(fd->type);
            char *arr = calloc(n, sz);
            assert_non_null(arr);
            for (size_t j = 0; j < n; j++)
                fill_value(fd, arr + j * sz, (unsigned)j);
            *(size_t *)((char *)m + fd->quantifier_offset) = n;
            *(void **)member = arr;
        } else {
            fill_value(fd, member, 0);
        }
    }
}

static void assert_messages_equal(const ProtobufCMessage *a, const ProtobufCMessage *b);

static void assert_value_equal(const ProtobufCFieldDescriptor *fd, const void *a, const void *b)
{
    switch (fd->type) {
    case PROTOBUF_C_TYPE_STRING: assert_string_equal(*(char *const *)a, *(char *const *)b); break;
    case PROTOBUF_C_TYPE_BYTES: {
        const ProtobufCBinaryData *x = a, *y = b;
        assert_int_equal(x->len, y->len);
        assert_memory_equal(x->data, y->data, x->len);
        break;
    }
    case PROTOBUF_C_TYPE_MESSAGE: {
        const ProtobufCMessage *x = *(ProtobufCMessage *const *)a;
        const ProtobufCMessage *y = *(ProtobufCMessage *const *)b;
        assert_non_null(x);
        assert_non_null(y);
        assert_messages_equal(x, y);
        break;
    }
    default: /* numbers, bools and enums: bit for bit */
        assert_memory_equal(a, b, value_size(fd->type));
    }
}

static void assert_messages_equal(const ProtobufCMessage *a, const ProtobufCMessage *b)
{
    const ProtobufCMessageDescriptor *d = a->descriptor;
    assert_ptr_equal(d, b->descriptor);
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *fd = &d->fields[i];
        const char *pa = (const char *)a + fd->offset, *pb = (const char *)b + fd->offset;
        if (fd->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
            uint32_t ca = *(const uint32_t *)((const char *)a + fd->quantifier_offset);
            uint32_t cb = *(const uint32_t *)((const char *)b + fd->quantifier_offset);
            assert_int_equal(ca, cb);
            if (ca == fd->id)
                assert_value_equal(fd, pa, pb);
        } else if (fd->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t na = *(const size_t *)((const char *)a + fd->quantifier_offset);
            size_t nb = *(const size_t *)((const char *)b + fd->quantifier_offset);
            assert_int_equal(na, nb);
            size_t sz = value_size(fd->type);
            for (size_t j = 0; j < na; j++)
                assert_value_equal(fd, *(char *const *)pa + j * sz, *(char *const *)pb + j * sz);
        } else {
            assert_value_equal(fd, pa, pb);
        }
    }
}

/* True when every field (except enums that only have the value 0, and oneof members not
 * chosen) holds a non-default value: the round trip carried something in each. */
static void assert_all_set(const ProtobufCMessage *m)
{
    const ProtobufCMessageDescriptor *d = m->descriptor;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *fd = &d->fields[i];
        const char *p = (const char *)m + fd->offset;
        if (fd->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
            if (*(const uint32_t *)((const char *)m + fd->quantifier_offset) != fd->id)
                continue;
        } else if (fd->label == PROTOBUF_C_LABEL_REPEATED) {
            if (*(const size_t *)((const char *)m + fd->quantifier_offset) == 0)
                fail_msg("%s.%s: repeated field empty", d->name, fd->name);
            continue;
        }
        switch (fd->type) {
        case PROTOBUF_C_TYPE_STRING:
            if (!**(char *const *)p)
                fail_msg("%s.%s: empty string", d->name, fd->name);
            break;
        case PROTOBUF_C_TYPE_BYTES:
            if (((const ProtobufCBinaryData *)p)->len == 0)
                fail_msg("%s.%s: empty bytes", d->name, fd->name);
            break;
        case PROTOBUF_C_TYPE_MESSAGE:
            if (!*(ProtobufCMessage *const *)p)
                fail_msg("%s.%s: no submessage", d->name, fd->name);
            assert_all_set(*(ProtobufCMessage *const *)p);
            break;
        case PROTOBUF_C_TYPE_ENUM:
            if (*(const int *)p == 0 && enum_value(fd->descriptor, 0) != 0)
                fail_msg("%s.%s: enum left at 0", d->name, fd->name);
            break;
        default: {
            static const uint8_t zero[8];
            if (memcmp(p, zero, value_size(fd->type)) == 0)
                fail_msg("%s.%s: zero", d->name, fd->name);
        }
        }
    }
}

static void test_round_trip_every_message(void **state)
{
    (void)state;
    unsigned instances = 0;
    for (size_t i = 0; i < N_MESSAGES; i++) {
        const ProtobufCMessageDescriptor *d = messages[i];
        assert_int_equal(d->magic, PROTOBUF_C__MESSAGE_DESCRIPTOR_MAGIC);
        for (unsigned v = 0; v < n_variants(d); v++) {
            ProtobufCMessage *m = malloc(d->sizeof_message);
            assert_non_null(m);
            d->message_init(m);
            fill_message(m, v);
            assert_all_set(m);
            size_t n = protobuf_c_message_get_packed_size(m);
            uint8_t *buf = malloc(n + 1);
            assert_non_null(buf);
            assert_int_equal(protobuf_c_message_pack(m, buf), n);
            ProtobufCMessage *u = protobuf_c_message_unpack(d, NULL, n, buf);
            if (!u)
                fail_msg("%s variant %u does not unpack", d->name, v);
            assert_messages_equal(m, u);
            assert_all_set(u);
            /* packing the decoded message gives the same bytes */
            uint8_t *again = malloc(n + 1);
            assert_non_null(again);
            assert_int_equal(protobuf_c_message_get_packed_size(u), n);
            assert_int_equal(protobuf_c_message_pack(u, again), n);
            assert_memory_equal(buf, again, n);
            /* a truncated encoding is read without harm: it fails to decode or gives a
             * shorter message (ASan runs watch the reads) */
            if (n > 1) {
                ProtobufCMessage *t = protobuf_c_message_unpack(d, NULL, n - 1, buf);
                if (t)
                    protobuf_c_message_free_unpacked(t, NULL);
            }
            protobuf_c_message_free_unpacked(u, NULL);
            protobuf_c_message_free_unpacked(m, NULL);
            free(again);
            free(buf);
            instances++;
        }
    }
    /* GenerateRequest's `input` oneof has three members: three instances of it; MetricSample's
     * `value` two */
    assert_int_equal(n_variants(&tandem__v1__generate_request__descriptor), 3);
    assert_int_equal(n_variants(&tandem__v1__metric_sample__descriptor), 2);
    assert_int_equal(instances, N_MESSAGES + 3);
}

/* The table names every message the .proto file declares. */
static void test_table_covers_proto(void **state)
{
    (void)state;
    char *text;
    size_t len;
    tdm_error_t err = {0};
    assert_int_equal(
        tdm_read_file(TDM_SOURCE_DIR "/proto/tandem.proto", 1 << 20, &text, &len, &err), 0);
    unsigned declared = 0;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        char name[128];
        if (sscanf(line, " message %127[A-Za-z0-9_]", name) != 1)
            continue;
        declared++;
        char full[160];
        snprintf(full, sizeof full, "tandem.v1.%s", name);
        bool found = false;
        for (size_t i = 0; i < N_MESSAGES; i++)
            found = found || strcmp(messages[i]->name, full) == 0;
        if (!found)
            fail_msg("message %s is not in test_proto.c's table", full);
    }
    free(text);
    assert_int_equal(declared, N_MESSAGES);
}

/* The FrameHeader's encoding is the wire contract: fixed bytes for a known header. */
static void test_frame_header_bytes(void **state)
{
    (void)state;
    Tandem__V1__FrameHeader h = TANDEM__V1__FRAME_HEADER__INIT;
    h.version_major = 1;
    h.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_END;
    h.method = TANDEM__V1__METHOD__METHOD_KV_TRANSFER;
    h.call_id = 300;
    h.status = 5;
    h.message = "x";
    uint8_t buf[64];
    size_t n = tandem__v1__frame_header__pack(&h, buf);
    static const uint8_t want[] = {0x08, 0x01, 0x18, 0x03, 0x20, 0x20, 0x28,
                                   0xac, 0x02, 0x30, 0x05, 0x3a, 0x01, 'x'};
    assert_int_equal(n, sizeof want);
    assert_memory_equal(buf, want, sizeof want);
    /* an empty header is zero bytes and decodes to all defaults */
    Tandem__V1__FrameHeader e = TANDEM__V1__FRAME_HEADER__INIT;
    assert_int_equal(tandem__v1__frame_header__get_packed_size(&e), 0);
}

static void test_sampling_round_trip(void **state)
{
    (void)state;
    tdm_sampling_params_t p;
    tdm_sampling_params_default(&p);
    p.temperature = 0.7f;
    p.top_k = 40;
    p.top_p = 0.9f;
    p.min_p = 0.05f;
    p.repetition_penalty = 1.1f;
    p.presence_penalty = 0.5f;
    p.frequency_penalty = -0.25f;
    p.penalty_last_n = -1;
    p.seed = UINT64_C(0x123456789abcdef0);
    p.max_tokens = 99;
    p.stop_token_ids[0] = 5;
    p.stop_token_ids[1] = 6;
    p.stop_token_ids[2] = 70000;
    p.n_stop_token_ids = 3;
    p.ignore_eos = true;
    p.n_logprobs = 3;

    tdm_proto_sampling_t pm;
    tdm_proto_sampling_to(&p, &pm);
    Tandem__V1__SamplingParams m = pm.m;
    assert_int_equal(m.set_mask, 0xffffffffu);
    assert_true(m.has_seed);
    assert_int_equal(m.n_stop_token_ids, 3);
    assert_ptr_equal(m.stop_token_ids, p.stop_token_ids); /* points into p, no allocation */

    uint8_t buf[256];
    size_t n = tandem__v1__sampling_params__pack(&m, buf);
    Tandem__V1__SamplingParams *u = tandem__v1__sampling_params__unpack(NULL, n, buf);
    assert_non_null(u);
    tdm_sampling_params_t q;
    tdm_sampling_params_default(&q);
    q.max_tokens = 7;
    tdm_error_t err = {0};
    assert_int_equal(tdm_proto_sampling_from(u, &q, &err), 0);
    tandem__v1__sampling_params__free_unpacked(u, NULL);
    assert_true(q.temperature == 0.7f);
    assert_int_equal(q.top_k, 40);
    assert_true(q.top_p == 0.9f);
    assert_true(q.min_p == 0.05f);
    assert_true(q.repetition_penalty == 1.1f);
    assert_true(q.presence_penalty == 0.5f);
    assert_true(q.frequency_penalty == -0.25f);
    assert_int_equal(q.penalty_last_n, -1);
    assert_int_equal(q.seed, UINT64_C(0x123456789abcdef0));
    assert_int_equal(q.n_stop_token_ids, 3);
    assert_int_equal(q.stop_token_ids[2], 70000);
    assert_true(q.ignore_eos);
    assert_int_equal(q.n_logprobs, 3);
    assert_int_equal(q.max_tokens, 7); /* not part of the message: left alone */
}

static void test_sampling_set_mask(void **state)
{
    (void)state;
    Tandem__V1__SamplingParams m = TANDEM__V1__SAMPLING_PARAMS__INIT;
    int32_t ids[2] = {11, 12};
    m.temperature = 0.0f; /* greedy, given explicitly: proto3 alone could not say so */
    m.top_k = 5;
    m.top_p = 0.5f;         /* not in the mask: ignored */
    m.penalty_last_n = 0;   /* in the mask: penalties off */
    m.n_logprobs = 9;       /* not in the mask */
    m.n_stop_token_ids = 2; /* not in the mask */
    m.stop_token_ids = ids;
    m.seed = 99;
    m.set_mask = TDM_PROTO_SET_TEMPERATURE | TDM_PROTO_SET_TOP_K | TDM_PROTO_SET_PENALTY_LAST_N;
    tdm_sampling_params_t q, def;
    tdm_sampling_params_default(&q);
    tdm_sampling_params_default(&def);
    tdm_error_t err = {0};
    assert_int_equal(tdm_proto_sampling_from(&m, &q, &err), 0);
    assert_true(q.temperature == 0.0f);
    assert_int_equal(q.top_k, 5);
    assert_int_equal(q.penalty_last_n, 0);
    assert_true(q.top_p == def.top_p);
    assert_int_equal(q.n_logprobs, 0);
    assert_int_equal(q.n_stop_token_ids, 0);
    assert_int_equal(q.seed, 0); /* neither the mask bit nor has_seed */
    assert_true(q.repetition_penalty == 1.0f);

    /* has_seed alone carries the seed (the client API's own flag) */
    m.has_seed = true;
    assert_int_equal(tdm_proto_sampling_from(&m, &q, &err), 0);
    assert_int_equal(q.seed, 99);
    /* the stop-id bit with an empty list clears the caller's ids */
    q.n_stop_token_ids = 1;
    q.stop_token_ids[0] = 3;
    m.n_stop_token_ids = 0;
    m.set_mask = TDM_PROTO_SET_STOP_TOKEN_IDS | TDM_PROTO_SET_IGNORE_EOS;
    m.ignore_eos = false;
    q.ignore_eos = true;
    assert_int_equal(tdm_proto_sampling_from(&m, &q, &err), 0);
    assert_int_equal(q.n_stop_token_ids, 0);
    assert_false(q.ignore_eos);
}

/* tdm_proto_sampling_from refuses m with msg and copies nothing. */
static void from_refused(const Tandem__V1__SamplingParams *m, const char *msg)
{
    tdm_sampling_params_t q, before;
    tdm_sampling_params_default(&q);
    before = q;
    tdm_error_t err = {0};
    assert_int_equal(tdm_proto_sampling_from(m, &q, &err), TDM_EINVALID);
    assert_string_equal(err.msg, msg);
    assert_memory_equal(&q, &before, sizeof q); /* nothing copied */
}

/* min_tokens, bad-word token sequences and allowed_token_ids through the message and back;
 * a bad_words entry with text is the router's (skipped), one with both is refused by index. */
static void test_sampling_request_masks_round_trip(void **state)
{
    (void)state;
    tdm_sampling_params_t p;
    tdm_sampling_params_default(&p);
    tdm_error_t err = {0};
    p.min_tokens = 7;
    int32_t a[1] = {42}, b[3] = {5, 6, 7};
    assert_int_equal(tdm_sampling_bad_seq_add(&p, a, 1, &err), 0);
    assert_int_equal(tdm_sampling_bad_seq_add(&p, b, 3, &err), 0);
    p.allowed[0] = 9;
    p.allowed[1] = 3;
    p.n_allowed = 2;
    tdm_proto_sampling_t pm;
    tdm_proto_sampling_to(&p, &pm);
    uint8_t buf[256];
    size_t n = tandem__v1__sampling_params__pack(&pm.m, buf);
    assert_true(n < sizeof buf);
    Tandem__V1__SamplingParams *u = tandem__v1__sampling_params__unpack(NULL, n, buf);
    assert_non_null(u);
    assert_int_equal(u->n_bad_words, 2);
    tdm_sampling_params_t q;
    tdm_sampling_params_default(&q);
    assert_int_equal(tdm_proto_sampling_from(u, &q, &err), 0);
    assert_int_equal(q.min_tokens, 7);
    assert_int_equal(q.n_bad_seqs, 2);
    assert_int_equal(q.bad_end[0], 1);
    assert_int_equal(q.bad_end[1], 4);
    assert_int_equal(q.bad_tokens[0], 42);
    assert_int_equal(q.bad_tokens[3], 7);
    assert_int_equal(q.n_allowed, 2);
    assert_int_equal(q.allowed[0], 9); /* the client's order */
    assert_int_equal(q.allowed[1], 3);
    /* a word (text) is skipped; text and ids together are refused, naming the entry */
    char *text = u->bad_words[0]->text; /* restored before freeing: protobuf-c owns it */
    u->bad_words[0]->text = (char *)"word";
    u->bad_words[0]->n_ids = 0;
    assert_int_equal(tdm_proto_sampling_from(u, &q, &err), 0);
    assert_int_equal(q.n_bad_seqs, 1);
    u->bad_words[0]->n_ids = 1;
    assert_int_equal(tdm_proto_sampling_from(u, &q, &err), TDM_EINVALID);
    assert_string_equal(err.field, "sampling.bad_words[0]");
    u->bad_words[0]->text = text;
    tandem__v1__sampling_params__free_unpacked(u, NULL);
}

/* logit_bias through the message and back: entries in any order arrive sorted by token id,
 * with their biases bit for bit; the validator then accepts them. */
static void test_sampling_logit_bias_round_trip(void **state)
{
    (void)state;
    tdm_sampling_params_t p;
    tdm_sampling_params_default(&p);
    tdm_error_t err = {0};
    assert_int_equal(tdm_sampling_logit_bias_add(&p, 900, -100.0f, &err), 0);
    assert_int_equal(tdm_sampling_logit_bias_add(&p, 3, 2.5f, &err), 0);
    assert_int_equal(tdm_sampling_logit_bias_add(&p, 49151, 100.0f, &err), 0);
    tdm_proto_sampling_t pm;
    tdm_proto_sampling_to(&p, &pm);
    assert_int_equal(pm.m.n_logit_bias, 3);
    assert_int_equal(pm.m.logit_bias[0]->token_id, 3);
    assert_int_equal(pm.m.logit_bias[2]->token_id, 49151);

    uint8_t buf[256];
    size_t n = tandem__v1__sampling_params__pack(&pm.m, buf);
    assert_true(n < sizeof buf);
    Tandem__V1__SamplingParams *u = tandem__v1__sampling_params__unpack(NULL, n, buf);
    assert_non_null(u);
    /* reverse the entries: the receiver must not depend on the sender's order */
    Tandem__V1__LogitBias *t = u->logit_bias[0];
    u->logit_bias[0] = u->logit_bias[2];
    u->logit_bias[2] = t;
    tdm_sampling_params_t q;
    tdm_sampling_params_default(&q);
    assert_int_equal(tdm_proto_sampling_from(u, &q, &err), 0);
    tandem__v1__sampling_params__free_unpacked(u, NULL);
    assert_int_equal(q.n_logit_bias, 3);
    assert_int_equal(q.logit_bias[0].token, 3);
    assert_true(q.logit_bias[0].bias == 2.5f);
    assert_int_equal(q.logit_bias[1].token, 900);
    assert_true(q.logit_bias[1].bias == -100.0f);
    assert_int_equal(q.logit_bias[2].token, 49151);
    assert_true(q.logit_bias[2].bias == 100.0f);
    assert_int_equal(tdm_sampling_params_validate(&q, 49152, &err), 0);
    assert_int_equal(tdm_sampling_params_validate(&q, 49151, &err), TDM_EINVALID);
    assert_string_equal(err.msg,
                        "logit_bias[\"49151\"]: the token id must be in [0, 49151), got 49151");

    /* without the mask bit the caller's entries stay; with it and none, they are cleared */
    Tandem__V1__SamplingParams e = TANDEM__V1__SAMPLING_PARAMS__INIT;
    e.set_mask = TDM_PROTO_SET_TEMPERATURE;
    assert_int_equal(tdm_proto_sampling_from(&e, &q, &err), 0);
    assert_int_equal(q.n_logit_bias, 3);
    e.set_mask = TDM_PROTO_SET_LOGIT_BIAS;
    assert_int_equal(tdm_proto_sampling_from(&e, &q, &err), 0);
    assert_int_equal(q.n_logit_bias, 0);
}

/* More than TDM_SAMPLING_MAX_LOGIT_BIAS entries are refused naming the field; nothing is
 * copied. A repeated token id arrives repeated, for the validator to name. */
static void test_sampling_logit_bias_refused(void **state)
{
    (void)state;
    enum { N = TDM_SAMPLING_MAX_LOGIT_BIAS + 1 };
    static Tandem__V1__LogitBias b[N];
    static Tandem__V1__LogitBias *bp[N];
    for (int i = 0; i < N; i++) {
        tandem__v1__logit_bias__init(&b[i]);
        b[i].token_id = i;
        b[i].bias = 1.0f;
        bp[i] = &b[i];
    }
    Tandem__V1__SamplingParams m = TANDEM__V1__SAMPLING_PARAMS__INIT;
    m.logit_bias = bp;
    m.n_logit_bias = N;
    m.set_mask = 0xffffffffu;
    from_refused(&m, "sampling.logit_bias: 301 entries given, at most 300 allowed");

    tdm_sampling_params_t q;
    tdm_sampling_params_default(&q);
    tdm_error_t err = {0};
    b[1].token_id = 0;
    m.n_logit_bias = 2;
    assert_int_equal(tdm_proto_sampling_from(&m, &q, &err), 0);
    uint32_t bad = 99;
    assert_int_equal(tdm_sampling_logit_bias_check(&q, 100, &bad, &err), TDM_EINVALID);
    assert_int_equal(bad, 1);
    assert_string_equal(err.msg, "logit_bias[\"0\"]: each token id must appear once, got 0 twice");
}

static void test_sampling_too_many_stop_ids(void **state)
{
    (void)state;
    int32_t ids[TDM_SAMPLING_MAX_STOP + 1];
    for (int i = 0; i <= TDM_SAMPLING_MAX_STOP; i++)
        ids[i] = i + 1;
    Tandem__V1__SamplingParams m = TANDEM__V1__SAMPLING_PARAMS__INIT;
    m.stop_token_ids = ids;
    m.n_stop_token_ids = TDM_SAMPLING_MAX_STOP + 1;
    m.temperature = 0.3f;
    m.set_mask = 0xffffffffu;
    from_refused(&m, "sampling.stop_token_ids: 17 ids given, at most 16 allowed");
    tdm_sampling_params_t q;
    tdm_sampling_params_default(&q);
    tdm_error_t err = {0};
    /* exactly 16 is fine */
    m.n_stop_token_ids = TDM_SAMPLING_MAX_STOP;
    assert_int_equal(tdm_proto_sampling_from(&m, &q, &err), 0);
    assert_int_equal(q.n_stop_token_ids, 16);
    assert_int_equal(q.stop_token_ids[15], 16);
}

static void test_layout(void **state)
{
    (void)state;
    tdm_kv_layout_t l = {
        .n_layers = 30, .n_kv_heads = 3, .head_dim = 64, .block_size = 16, .dtype = TDM_KV_Q8};
    Tandem__V1__KvLayout m;
    tdm_proto_layout_to(&l, &m);
    uint8_t buf[64];
    size_t n = tandem__v1__kv_layout__pack(&m, buf);
    Tandem__V1__KvLayout *u = tandem__v1__kv_layout__unpack(NULL, n, buf);
    assert_non_null(u);
    assert_int_equal(u->dtype, TANDEM__V1__KV_DTYPE__KV_DTYPE_Q8);
    tdm_kv_layout_t back;
    memset(&back, 0, sizeof back);
    tdm_error_t err = {0};
    assert_int_equal(tdm_proto_layout_from(u, &back, &err), 0);
    tandem__v1__kv_layout__free_unpacked(u, NULL);
    assert_int_equal(back.n_layers, 30);
    assert_int_equal(back.n_kv_heads, 3);
    assert_int_equal(back.head_dim, 64);
    assert_int_equal(back.block_size, 16);
    assert_int_equal(back.dtype, TDM_KV_Q8);
    /* every dtype maps to itself */
    for (int d = TDM_KV_F32; d <= TDM_KV_Q8; d++) {
        l.dtype = (tdm_kv_dtype_t)d;
        tdm_proto_layout_to(&l, &m);
        assert_int_equal(tdm_proto_layout_from(&m, &back, &err), 0);
        assert_int_equal(back.dtype, d);
    }
    /* an unknown dtype (a newer peer's) is refused and nothing is written */
    m.dtype = (Tandem__V1__KvDtype)7;
    back.n_layers = 1234;
    assert_int_equal(tdm_proto_layout_from(&m, &back, &err), TDM_EINVALID);
    assert_string_equal(err.msg, "layout.dtype: unknown value 7");
    assert_int_equal(back.n_layers, 1234);
    m.dtype = (Tandem__V1__KvDtype)-1;
    assert_int_equal(tdm_proto_layout_from(&m, &back, &err), TDM_EINVALID);
}

static void test_status_codes(void **state)
{
    (void)state;
    assert_int_equal(tdm_proto_status_to_wire(TDM_OK), 0);
    assert_int_equal(tdm_proto_status_to_wire(TDM_EINVALID), 3);
    assert_int_equal(tdm_proto_status_to_wire(TDM_EUNAUTHENTICATED), 16);
    assert_int_equal(tdm_proto_status_from_wire(0), TDM_OK);
    assert_int_equal(tdm_proto_status_from_wire(9), TDM_EPRECONDITION);
    assert_int_equal(tdm_proto_status_from_wire(14), TDM_EUNAVAILABLE);
    assert_int_equal(tdm_proto_status_from_wire(-5), TDM_OK); /* not a code: treated as OK */
    assert_int_equal(tdm_proto_status_from_wire(99), -99);    /* unknown: number kept */
    for (int c = 0; c <= 16; c++)
        assert_int_equal(tdm_proto_status_to_wire(tdm_proto_status_from_wire(c)), c);
}

static void test_finish_names(void **state)
{
    (void)state;
    assert_string_equal(tdm_proto_finish_name(TANDEM__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED),
                        "none");
    assert_string_equal(tdm_proto_finish_name(TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP),
                        "stop");
    assert_string_equal(tdm_proto_finish_name(TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH),
                        "length");
    assert_string_equal(tdm_proto_finish_name(TANDEM__V1__FINISH_REASON__FINISH_REASON_CANCELLED),
                        "cancelled");
    assert_string_equal(tdm_proto_finish_name(TANDEM__V1__FINISH_REASON__FINISH_REASON_ERROR),
                        "error");
    assert_string_equal(tdm_proto_finish_name(5), "?");
    assert_string_equal(tdm_proto_finish_name(-1), "?");
}

/* A counter with escaped labels, an unlabelled integer gauge, a float gauge without samples
 * and with one, and a histogram: the exact text, and find by name. */
static void test_metrics_text(void **state)
{
    (void)state;
    Tandem__V1__MetricLabel l0 = TANDEM__V1__METRIC_LABEL__INIT,
                            l1 = TANDEM__V1__METRIC_LABEL__INIT;
    l0.name = "node";
    l0.value = "a\"b\\c\nd";
    l1.name = "role";
    l1.value = "decode";
    Tandem__V1__MetricLabel *labels[2] = {&l0, &l1};
    Tandem__V1__MetricSample s0 = TANDEM__V1__METRIC_SAMPLE__INIT,
                             s1 = TANDEM__V1__METRIC_SAMPLE__INIT,
                             s2 = TANDEM__V1__METRIC_SAMPLE__INIT;
    s0.n_labels = 2;
    s0.labels = labels;
    s0.value_case = TANDEM__V1__METRIC_SAMPLE__VALUE_INT_VALUE;
    s0.int_value = 18446744073709551615ull;
    s1.value_case = TANDEM__V1__METRIC_SAMPLE__VALUE_INT_VALUE;
    s1.int_value = 0;
    s2.n_labels = 1;
    s2.labels = &labels[1];
    s2.value_case = TANDEM__V1__METRIC_SAMPLE__VALUE_FLOAT_VALUE;
    s2.float_value = 0.1;
    Tandem__V1__MetricSample *p0[1] = {&s0}, *p1[1] = {&s1}, *p2[1] = {&s2};
    double bounds[2] = {0.005, 2.5};
    uint64_t counts[2] = {3, 1};
    Tandem__V1__MetricHistogram h = TANDEM__V1__METRIC_HISTOGRAM__INIT;
    h.n_bounds = h.n_counts = 2;
    h.bounds = bounds;
    h.counts = counts;
    h.sum = 1.0 / 3.0;
    h.count = 6;
    Tandem__V1__MetricFamily f[5];
    for (int i = 0; i < 5; i++)
        tandem__v1__metric_family__init(&f[i]);
    f[0].name = "x_total";
    f[0].help = "Things.";
    f[0].n_samples = 1;
    f[0].samples = p0;
    f[1].name = "y";
    f[1].help = "Now.";
    f[1].type = TANDEM__V1__METRIC_TYPE__METRIC_TYPE_GAUGE;
    f[1].n_samples = 1;
    f[1].samples = p1;
    f[2].name = "none";
    f[2].help = "Empty.";
    f[2].type = TANDEM__V1__METRIC_TYPE__METRIC_TYPE_GAUGE;
    f[3].name = "z_seconds";
    f[3].help = "Float.";
    f[3].type = TANDEM__V1__METRIC_TYPE__METRIC_TYPE_GAUGE;
    f[3].n_samples = 1;
    f[3].samples = p2;
    f[4].name = "h_seconds";
    f[4].help = "Times.";
    f[4].type = TANDEM__V1__METRIC_TYPE__METRIC_TYPE_HISTOGRAM;
    f[4].histogram = &h;
    Tandem__V1__MetricFamily *fp[5] = {&f[0], &f[1], &f[2], &f[3], &f[4]};
    Tandem__V1__MetricsResponse m = TANDEM__V1__METRICS_RESPONSE__INIT;
    m.n_families = 5;
    m.families = fp;
    tdm_buf_t b = TDM_BUF_INIT;
    assert_int_equal(tdm_proto_metrics_text(&m, &b), 0);
    assert_string_equal(b.data, "# HELP x_total Things.\n# TYPE x_total counter\n"
                                "x_total{node=\"a\\\"b\\\\c\\nd\",role=\"decode\"} "
                                "18446744073709551615\n"
                                "# HELP y Now.\n# TYPE y gauge\ny 0\n"
                                "# HELP none Empty.\n# TYPE none gauge\n"
                                "# HELP z_seconds Float.\n# TYPE z_seconds gauge\n"
                                "z_seconds{role=\"decode\"} 0.1\n"
                                "# HELP h_seconds Times.\n# TYPE h_seconds histogram\n"
                                "h_seconds_bucket{le=\"0.005\"} 3\n"
                                "h_seconds_bucket{le=\"2.5\"} 4\n"
                                "h_seconds_bucket{le=\"+Inf\"} 6\n"
                                "h_seconds_sum 0.3333333333333333\nh_seconds_count 6\n");
    tdm_buf_free(&b);
    assert_ptr_equal(tdm_proto_metrics_find(&m, "z_seconds"), &f[3]);
    assert_null(tdm_proto_metrics_find(&m, "z"));
}

/* A histogram with labels (the vllm: ones): every line carries them, le last on buckets;
 * label values are escaped there too. */
static void test_metrics_text_labelled_histogram(void **state)
{
    (void)state;
    Tandem__V1__MetricLabel l0 = TANDEM__V1__METRIC_LABEL__INIT,
                            l1 = TANDEM__V1__METRIC_LABEL__INIT;
    l0.name = "model_name";
    l0.value = "m\"1";
    l1.name = "engine";
    l1.value = "0";
    Tandem__V1__MetricLabel *labels[2] = {&l0, &l1};
    double bounds[1] = {1};
    uint64_t counts[1] = {2};
    Tandem__V1__MetricHistogram h = TANDEM__V1__METRIC_HISTOGRAM__INIT;
    h.n_bounds = h.n_counts = 1;
    h.bounds = bounds;
    h.counts = counts;
    h.sum = 2.5;
    h.count = 3;
    Tandem__V1__MetricFamily f = TANDEM__V1__METRIC_FAMILY__INIT;
    f.name = "vllm:e2e_request_latency_seconds";
    f.help = "E2e.";
    f.type = TANDEM__V1__METRIC_TYPE__METRIC_TYPE_HISTOGRAM;
    f.histogram = &h;
    f.n_histogram_labels = 2;
    f.histogram_labels = labels;
    Tandem__V1__MetricFamily *fp[1] = {&f};
    Tandem__V1__MetricsResponse m = TANDEM__V1__METRICS_RESPONSE__INIT;
    m.n_families = 1;
    m.families = fp;
    tdm_buf_t b = TDM_BUF_INIT;
    assert_int_equal(tdm_proto_metrics_text(&m, &b), 0);
#define L "{model_name=\"m\\\"1\",engine=\"0\""
    assert_string_equal(b.data, "# HELP vllm:e2e_request_latency_seconds E2e.\n"
                                "# TYPE vllm:e2e_request_latency_seconds histogram\n"
                                "vllm:e2e_request_latency_seconds_bucket" L ",le=\"1\"} 2\n"
                                "vllm:e2e_request_latency_seconds_bucket" L ",le=\"+Inf\"} 3\n"
                                "vllm:e2e_request_latency_seconds_sum" L "} 2.5\n"
                                "vllm:e2e_request_latency_seconds_count" L "} 3\n");
#undef L
    tdm_buf_free(&b);
}

int main(void)
{
    messages = tdm_proto_messages(&n_messages);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip_every_message),
        cmocka_unit_test(test_table_covers_proto),
        cmocka_unit_test(test_frame_header_bytes),
        cmocka_unit_test(test_sampling_round_trip),
        cmocka_unit_test(test_sampling_set_mask),
        cmocka_unit_test(test_sampling_logit_bias_round_trip),
        cmocka_unit_test(test_sampling_request_masks_round_trip),
        cmocka_unit_test(test_sampling_logit_bias_refused),
        cmocka_unit_test(test_sampling_too_many_stop_ids),
        cmocka_unit_test(test_layout),
        cmocka_unit_test(test_status_codes),
        cmocka_unit_test(test_finish_names),
        cmocka_unit_test(test_metrics_text),
        cmocka_unit_test(test_metrics_text_labelled_histogram),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
