/* make_corpus.c - writes the seed inputs of fuzz_frame (tests/fuzz/corpus/frame/) in its
 * input layout: a flags byte (bit 0: ROUTER), then each part as a 2-byte little-endian length
 * and its bytes. Valid messages of each kind and a few malformed ones.
 * Usage: fuzz-make-corpus DIR */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/net.h"
#include "tandem/proto.h"

#define K(x) TANDEM__V1__FRAME_KIND__FRAME_KIND_##x
#define M(x) TANDEM__V1__METHOD__METHOD_##x

typedef struct input {
    uint8_t bytes[8192];
    size_t len;
} input_t;

static void start(input_t *in, int flags)
{
    in->bytes[0] = (uint8_t)flags;
    in->len = 1;
}

static void part(input_t *in, const void *p, size_t n)
{
    if (in->len + 2 + n > sizeof in->bytes || n > 0xffff) {
        fprintf(stderr, "make_corpus: input too big\n");
        exit(1);
    }
    in->bytes[in->len++] = (uint8_t)(n & 0xff);
    in->bytes[in->len++] = (uint8_t)(n >> 8);
    memcpy(in->bytes + in->len, p, n);
    in->len += n;
}

static void part_msg(input_t *in, const ProtobufCMessage *m)
{
    uint8_t buf[4096];
    size_t n = protobuf_c_message_get_packed_size(m);
    if (n > sizeof buf)
        exit(1);
    protobuf_c_message_pack(m, buf);
    part(in, buf, n);
}

static void header(input_t *in, uint32_t major, int kind, int method, uint64_t call_id, int status,
                   const char *message, uint32_t n_data)
{
    Tandem__V1__FrameHeader h = TANDEM__V1__FRAME_HEADER__INIT;
    h.version_major = major;
    h.kind = (Tandem__V1__FrameKind)kind;
    h.method = (Tandem__V1__Method)method;
    h.call_id = call_id;
    h.status = status;
    h.message = (char *)(uintptr_t)(message ? message : "");
    h.deadline_unix_ms = call_id ? UINT64_C(1900000000000) : 0;
    h.n_data_frames = n_data;
    part_msg(in, &h.base);
}

static void save(const char *dir, const char *name, const input_t *in)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(in->bytes, 1, in->len, f) != in->len || fclose(f) != 0) {
        fprintf(stderr, "make_corpus: cannot write %s\n", path);
        exit(1);
    }
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    input_t in;

    /* ROUTER: REQUEST HEALTH with an empty body */
    start(&in, 1);
    part(&in, "client-1", 8);
    header(&in, TDM_PROTOCOL_MAJOR, K(REQUEST), M(HEALTH), 1, 0, NULL, 0);
    part(&in, "", 0);
    save(dir, "router-health-request", &in);

    /* DEALER: END OK with a HealthResponse */
    Tandem__V1__HealthResponse hr = TANDEM__V1__HEALTH_RESPONSE__INIT;
    hr.live = hr.ready = true;
    hr.version = "0.1.0";
    start(&in, 0);
    header(&in, TDM_PROTOCOL_MAJOR, K(END), M(HEALTH), 1, 0, NULL, 0);
    part_msg(&in, &hr.base);
    save(dir, "dealer-health-end", &in);

    /* ROUTER: REQUEST GENERATE, chat input, sampling, stop strings */
    Tandem__V1__ChatMessage cm = TANDEM__V1__CHAT_MESSAGE__INIT, *cms[1] = {&cm};
    cm.role = "user";
    cm.content = "Hello";
    Tandem__V1__ChatList cl = TANDEM__V1__CHAT_LIST__INIT;
    cl.n_messages = 1;
    cl.messages = cms;
    Tandem__V1__SamplingParams sp = TANDEM__V1__SAMPLING_PARAMS__INIT;
    int32_t stop_ids[2] = {2, 7};
    sp.temperature = 0.7f;
    sp.top_p = 0.9f;
    sp.n_stop_token_ids = 2;
    sp.stop_token_ids = stop_ids;
    sp.set_mask = 0x405;
    Tandem__V1__GenerateRequest gr = TANDEM__V1__GENERATE_REQUEST__INIT;
    char *stops[1] = {"\n\n"};
    gr.request_id = "req-1";
    gr.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT;
    gr.chat = &cl;
    gr.sampling = &sp;
    gr.max_tokens = 32;
    gr.n_stop = 1;
    gr.stop = stops;
    gr.stream = true;
    start(&in, 1);
    part(&in, "\x00\x80\x00\x00\x29", 5); /* a ZMQ-made routing id */
    header(&in, TDM_PROTOCOL_MAJOR, K(REQUEST), M(GENERATE), 7, 0, NULL, 0);
    part_msg(&in, &gr.base);
    save(dir, "router-generate-chat", &in);

    /* DEALER: STREAM GenerateChunk */
    Tandem__V1__GenerateChunk gc = TANDEM__V1__GENERATE_CHUNK__INIT;
    int32_t toks[3] = {1000, 1001, 1002};
    float lps[3] = {-0.1f, -0.2f, -0.3f};
    gc.request_id = "req-1";
    gc.index = 3;
    gc.n_token_ids = 3;
    gc.token_ids = toks;
    gc.n_logprobs = 3;
    gc.logprobs = lps;
    gc.text = "abc";
    start(&in, 0);
    header(&in, TDM_PROTOCOL_MAJOR, K(STREAM), M(GENERATE), 7, 0, NULL, 0);
    part_msg(&in, &gc.base);
    save(dir, "dealer-generate-stream", &in);

    /* DEALER: END with an error status and message */
    start(&in, 0);
    header(&in, TDM_PROTOCOL_MAJOR, K(END), M(GENERATE), 7, 3, "max_tokens must be >= 1, got 0", 0);
    save(dir, "dealer-error-end", &in);

    /* ROUTER: KV_TRANSFER header + two data frames */
    Tandem__V1__KvLayout kl = TANDEM__V1__KV_LAYOUT__INIT;
    kl.n_layers = 2;
    kl.n_kv_heads = 1;
    kl.head_dim = 4;
    kl.block_size = 2;
    kl.dtype = TANDEM__V1__KV_DTYPE__KV_DTYPE_F16;
    uint64_t sums[2] = {0x1111, 0x2222};
    Tandem__V1__KvTransfer kt = TANDEM__V1__KV_TRANSFER__INIT;
    kt.request_id = "req-1";
    kt.transfer_id = 5;
    kt.n_tokens = 3;
    kt.layout = &kl;
    kt.n_blocks = 2;
    kt.block_bytes = 32;
    kt.n_checksums = 2;
    kt.checksums = sums;
    kt.backend = "tcp";
    uint8_t block[32];
    for (int i = 0; i < 32; i++)
        block[i] = (uint8_t)i;
    start(&in, 1);
    part(&in, "prefill-0", 9);
    header(&in, TDM_PROTOCOL_MAJOR, K(REQUEST), M(KV_TRANSFER), 9, 0, NULL, 2);
    part_msg(&in, &kt.base);
    part(&in, block, sizeof block);
    part(&in, block, sizeof block);
    save(dir, "router-kv-transfer", &in);

    /* ROUTER: NOTIFY Heartbeat (a sub-message with a packed repeated field) */
    Tandem__V1__Heartbeat hb = TANDEM__V1__HEARTBEAT__INIT;
    Tandem__V1__NodeLoad load = TANDEM__V1__NODE_LOAD__INIT;
    uint64_t counts[3] = {4, 2, 1};
    hb.node_id = "decode-0";
    load.kv_blocks_free = 100;
    load.step_s = 0.015;
    load.n_iteration_tokens_counts = 3;
    load.iteration_tokens_counts = counts;
    hb.load = &load;
    start(&in, 1);
    part(&in, "decode-0", 8);
    header(&in, TDM_PROTOCOL_MAJOR, K(NOTIFY), M(HEARTBEAT), 0, 0, NULL, 0);
    part_msg(&in, &hb.base);
    save(dir, "router-heartbeat-notify", &in);

    /* malformed: another major version */
    start(&in, 1);
    part(&in, "c", 1);
    header(&in, TDM_PROTOCOL_MAJOR - 1, K(REQUEST), M(HEALTH), 4, 0, NULL, 0);
    save(dir, "bad-version", &in);

    /* malformed: garbage header */
    start(&in, 0);
    part(&in, "\xff\xff\xff\xff\xff", 5);
    save(dir, "bad-garbage-header", &in);

    /* malformed: n_data_frames does not match */
    start(&in, 0);
    header(&in, TDM_PROTOCOL_MAJOR, K(REQUEST), M(KV_TRANSFER), 4, 0, NULL, 3);
    part(&in, block, 4);
    save(dir, "bad-n-data", &in);

    /* malformed: unknown kind */
    start(&in, 1);
    part(&in, "c", 1);
    header(&in, TDM_PROTOCOL_MAJOR, 9, M(HEALTH), 4, 0, NULL, 0);
    save(dir, "bad-kind", &in);

    /* malformed: too many parts (drained beyond those kept) */
    start(&in, 1 | (3 << 1));
    part(&in, "c", 1);
    header(&in, TDM_PROTOCOL_MAJOR, K(REQUEST), M(HEALTH), 4, 0, NULL, 0);
    save(dir, "bad-too-many-parts", &in);
    return 0;
}
