/* fuzz_frame.c - libFuzzer target for the receive path of common/net: the input becomes the
 * parts of one ZeroMQ message, goes through tdm_net_parse (the validation and FrameHeader
 * decoding tdm_sock_recv runs on every message) and, when accepted, its body through
 * tdm_frame_unpack as every message type of tandem.proto.
 *
 * Input layout: byte 0 holds flags (bit 0: ROUTER socket, so the first part is the sender's
 * routing id; bits 1-3: parts the message had beyond those given, as when tdm_sock_recv
 * drains a message with too many parts). Then the parts, each a 2-byte little-endian length
 * and that many bytes; a length past the end takes what is left. At most 64 parts.
 * tests/fuzz/make_corpus.c writes the seed inputs in this layout. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "net/net_internal.h"
#include "tandem/proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FUZZ_MAX_PARTS 64

/* An invariant of the parser does not hold: crash so libFuzzer keeps the input. */
#define FUZZ_CHECK(cond)                                                                           \
    do {                                                                                           \
        if (!(cond))                                                                               \
            __builtin_trap();                                                                      \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    bool router = data[0] & 1;
    size_t extra = (data[0] >> 1) & 7;
    tdm_net_part_t parts[FUZZ_MAX_PARTS];
    size_t n = 0, off = 1;
    while (off < size && n < FUZZ_MAX_PARTS) {
        size_t len = data[off];
        if (off + 1 < size)
            len |= (size_t)data[off + 1] << 8;
        off += 2;
        if (off > size)
            off = size;
        if (len > size - off)
            len = size - off;
        /* a private copy of each part, so ASan sees any read past its end */
        uint8_t *copy = malloc(len ? len : 1);
        if (!copy)
            goto out_free;
        memcpy(copy, data + off, len);
        parts[n].ptr = copy;
        parts[n].len = len;
        n++;
        off += len;
    }

    tdm_frame_t f;
    tdm_frame_init(&f);
    tdm_net_layout_t lay;
    tdm_error_t why;
    tdm_net_verdict_t v = tdm_net_parse(parts, n, n + extra, router, &f, &lay, &why);
    FUZZ_CHECK(strlen(f.message) < sizeof f.message);
    FUZZ_CHECK(strlen(f.api_key) < sizeof f.api_key);
    FUZZ_CHECK(f.peer_len <= TDM_NET_PEER_MAX);
    if (v == TDM_NET_ACCEPT) {
        FUZZ_CHECK(extra == 0);
        FUZZ_CHECK(f.version_major == TDM_PROTOCOL_MAJOR);
        FUZZ_CHECK(f.kind >= TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST &&
                   f.kind <= TANDEM__V1__FRAME_KIND__FRAME_KIND_NOTIFY);
        FUZZ_CHECK(f.status <= 0);
        FUZZ_CHECK(lay.header == (router ? 1u : 0u));
        FUZZ_CHECK((f.body == NULL) == (lay.body == SIZE_MAX));
        FUZZ_CHECK(f.body_len <= TDM_NET_MAX_BODY_BYTES);
        FUZZ_CHECK(lay.first_data + f.n_data == n);
        if (f.body) {
            FUZZ_CHECK(lay.body == lay.header + 1 && f.body_len == parts[lay.body].len);
            size_t n_messages;
            const ProtobufCMessageDescriptor *const *messages = tdm_proto_messages(&n_messages);
            for (size_t i = 0; i < n_messages; i++) {
                ProtobufCMessage *m = tdm_frame_unpack(&f, messages[i]);
                if (m)
                    protobuf_c_message_free_unpacked(m, NULL);
            }
        }
        volatile uint8_t sink = 0;
        for (uint32_t i = 0; i < f.n_data; i++) {
            const tdm_net_part_t *d = &parts[lay.first_data + i];
            FUZZ_CHECK(d->len <= TDM_NET_MAX_DATA_BYTES);
            for (size_t k = 0; k < d->len; k++)
                sink ^= d->ptr[k];
        }
        (void)sink;
    } else {
        FUZZ_CHECK(v == TDM_NET_REJECT || v == TDM_NET_DROP);
        FUZZ_CHECK(why.code < 0 && why.msg[0] != '\0');
        /* only a decoded REQUEST can be answered */
        FUZZ_CHECK(v == TDM_NET_DROP || f.kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST);
    }
    tdm_frame_clear(&f);

out_free:
    for (size_t i = 0; i < n; i++)
        free((void *)(uintptr_t)parts[i].ptr);
    return 0;
}
