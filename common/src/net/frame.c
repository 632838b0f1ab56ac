/* frame.c - received frames: validation and decoding of a message's parts (tdm_net_parse, the
 * path tdm_sock_recv and the fuzzer share), frame accessors, body decoding, deadlines, names.
 *
 * Limits are checked on part lengths before anything is decoded or allocated; only the
 * FrameHeader (at most TDM_NET_MAX_HEADER_BYTES) is decoded here. Bodies are decoded by the
 * caller through tdm_frame_unpack, with the type the method says.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "net/net_internal.h"

/* Stands in for a missing or zero-length part's bytes, so pointers are never NULL. */
static const uint8_t net_empty_bytes[1] = {0};

/* The FrameHeader is decoded into a stack arena (no malloc per message); what does not fit
 * (a header full of unknown fields) falls back to malloc and is freed through free_unpacked. */
typedef struct header_arena {
    size_t used;
    _Alignas(16) uint8_t buf[2 * TDM_NET_MAX_HEADER_BYTES];
} header_arena_t;

static void *arena_alloc(void *data, size_t size)
{
    header_arena_t *a = data;
    size_t off = (a->used + 15) & ~(size_t)15;
    if (size <= sizeof a->buf && off <= sizeof a->buf - size) {
        a->used = off + size;
        return a->buf + off;
    }
    return malloc(size);
}

static void arena_free(void *data, void *p)
{
    header_arena_t *a = data;
    uintptr_t x = (uintptr_t)p, lo = (uintptr_t)a->buf;
    if (x < lo || x >= lo + sizeof a->buf)
        free(p);
}

/* Length of the longest prefix of s that fits in cap bytes with its NUL and does not cut a
 * UTF-8 character in two. */
static size_t text_fit(const char *s, size_t cap)
{
    size_t n = strlen(s);
    if (n < cap)
        return n;
    n = cap - 1;
    /* back off over continuation bytes (10xxxxxx) to the start of the cut character */
    while (n > 0 && ((unsigned char)s[n] & 0xc0) == 0x80)
        n--;
    return n;
}

void tdm_net_frame_reset_fields(tdm_frame_t *f)
{
    void *impl = f->impl;
    size_t cap = f->impl_cap;
    memset(f, 0, sizeof *f);
    f->impl = impl;
    f->impl_cap = cap;
}

void tdm_frame_init(tdm_frame_t *f)
{
    memset(f, 0, sizeof *f);
}

void tdm_frame_clear(tdm_frame_t *f)
{
    if (!f)
        return;
    tdm_net_frame_impl_t *impl = f->impl;
    if (impl) {
        for (size_t i = 0; i < impl->n_msgs; i++)
            zmq_msg_close(&impl->msgs[i]);
        free(impl);
    }
    memset(f, 0, sizeof *f);
}

void tdm_frame_move(tdm_frame_t *dst, tdm_frame_t *src)
{
    tdm_frame_clear(dst);
    *dst = *src; /* the parts are on the heap (impl): their addresses do not change */
    memset(src, 0, sizeof *src);
}

const uint8_t *tdm_frame_data(const tdm_frame_t *f, uint32_t i, size_t *len)
{
    const tdm_net_frame_impl_t *impl = f ? f->impl : NULL;
    if (!impl || i >= f->n_data || impl->first_data + i >= impl->n_msgs) {
        if (len)
            *len = 0;
        return NULL;
    }
    /* zmq_msg_data/size take a non-const message but do not change it */
    zmq_msg_t *m = (zmq_msg_t *)(uintptr_t)&impl->msgs[impl->first_data + i];
    if (len)
        *len = zmq_msg_size(m);
    const uint8_t *p = zmq_msg_data(m);
    return p ? p : net_empty_bytes;
}

/* Sets *why and returns REJECT when the message is a REQUEST (it can be answered), DROP
 * otherwise. */
static tdm_net_verdict_t refuse(const tdm_frame_t *f, tdm_error_t *why, int code, const char *fmt,
                                ...) __attribute__((format(printf, 4, 5)));
static tdm_net_verdict_t refuse(const tdm_frame_t *f, tdm_error_t *why, int code, const char *fmt,
                                ...)
{
    why->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why->msg, sizeof why->msg, fmt, ap);
    va_end(ap);
    return f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST ? TDM_NET_REJECT : TDM_NET_DROP;
}

/* The FrameHeader's fields that travel as they are, copied into f; what the checks need next
 * (the wire status, the data frame count and the api_key's length) into the out-arguments.
 * Returns false with *why set when the header does not decode. The header is unpacked into
 * a stack arena: nothing is allocated. */
static bool header_decode(const tdm_net_part_t *part, tdm_frame_t *f, int32_t *wire_status,
                          uint32_t *n_data, size_t *key_len, tdm_error_t *why)
{
    header_arena_t arena;
    arena.used = 0;
    ProtobufCAllocator alloc = {.alloc = arena_alloc, .free = arena_free, .allocator_data = &arena};
    Tandem__V1__FrameHeader *hd = tandem__v1__frame_header__unpack(
        &alloc, part->len, part->ptr ? part->ptr : net_empty_bytes);
    if (!hd) {
        tdm_error_set(why, TDM_EINVALID, "FrameHeader does not decode (%zu bytes)", part->len);
        return false;
    }
    f->version_major = hd->version_major;
    f->version_minor = hd->version_minor;
    f->kind = (int)hd->kind;
    f->method = (int)hd->method;
    f->call_id = hd->call_id;
    f->deadline_unix_ms = hd->deadline_unix_ms;
    f->instance_id = hd->instance_id;
    *wire_status = hd->status;
    *n_data = hd->n_data_frames;
    size_t msg_len = text_fit(hd->message, sizeof f->message);
    memcpy(f->message, hd->message, msg_len);
    f->message[msg_len] = '\0';
    *key_len = strlen(hd->api_key);
    if (*key_len < sizeof f->api_key)
        memcpy(f->api_key, hd->api_key, *key_len + 1);
    tandem__v1__frame_header__free_unpacked(hd, &alloc);
    return true;
}

/* The header's fields that can be refused with an answer: version, kind, api_key length and
 * an END frame's status (set in f->status). */
static tdm_net_verdict_t header_check(tdm_frame_t *f, int32_t wire_status, size_t key_len,
                                      tdm_error_t *why)
{
    if (f->version_major != TDM_PROTOCOL_MAJOR)
        return refuse(f, why, TDM_EPRECONDITION,
                      "protocol version %u.%u not supported; this node speaks %u.x",
                      f->version_major, f->version_minor, TDM_PROTOCOL_MAJOR);
    if (f->kind < TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST ||
        f->kind > TANDEM__V1__FRAME_KIND__FRAME_KIND_NOTIFY)
        return refuse(f, why, TDM_EINVALID, "unknown frame kind %d", f->kind);
    if (key_len >= sizeof f->api_key)
        return refuse(f, why, TDM_EINVALID, "api_key of %zu bytes exceeds the limit of %zu bytes",
                      key_len, sizeof f->api_key - 1);
    if (f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END) {
        if (wire_status < 0)
            return refuse(f, why, TDM_EINVALID, "END status %d is not a status code",
                          (int)wire_status);
        f->status = tdm_proto_status_from_wire(wire_status);
    }
    return TDM_NET_ACCEPT;
}

/* The parts after the FrameHeader (part h): an optional body and n_data data frames, each
 * within its limit; sets the layout and f's body and data count. */
static tdm_net_verdict_t parts_check(const tdm_net_part_t *parts, size_t n_parts, size_t n_total,
                                     size_t h, uint32_t n_data, tdm_frame_t *f,
                                     tdm_net_layout_t *layout, tdm_error_t *why)
{
    if (n_data > TDM_NET_MAX_DATA_FRAMES)
        return refuse(f, why, TDM_ERESOURCE, "n_data_frames %u exceeds the limit of %u", n_data,
                      TDM_NET_MAX_DATA_FRAMES);
    size_t max_parts = h + 2 + TDM_NET_MAX_DATA_FRAMES;
    if (n_total > max_parts || n_parts < n_total)
        return refuse(f, why, TDM_ERESOURCE, "message of %zu parts; at most %zu allowed", n_total,
                      max_parts);
    size_t rest = n_total - h - 1;
    if (rest != n_data && rest != (size_t)n_data + 1)
        return refuse(f, why, TDM_EINVALID,
                      "n_data_frames is %u but %zu parts follow the FrameHeader", n_data, rest);
    size_t next = h + 1;
    if (rest == (size_t)n_data + 1) {
        if (parts[next].len > TDM_NET_MAX_BODY_BYTES)
            return refuse(f, why, TDM_ERESOURCE, "body of %zu bytes exceeds the limit of %u bytes",
                          parts[next].len, TDM_NET_MAX_BODY_BYTES);
        layout->body = next;
        f->body = parts[next].ptr ? parts[next].ptr : net_empty_bytes;
        f->body_len = parts[next].len;
        next++;
    }
    for (uint32_t i = 0; i < n_data; i++)
        if (parts[next + i].len > TDM_NET_MAX_DATA_BYTES)
            return refuse(f, why, TDM_ERESOURCE,
                          "data frame %u of %zu bytes exceeds the limit of %u bytes", i,
                          parts[next + i].len, TDM_NET_MAX_DATA_BYTES);
    layout->first_data = next;
    f->n_data = n_data;
    return TDM_NET_ACCEPT;
}

tdm_net_verdict_t tdm_net_parse(const tdm_net_part_t *parts, size_t n_parts, size_t n_total,
                                bool router, tdm_frame_t *f, tdm_net_layout_t *layout,
                                tdm_error_t *why)
{
    tdm_net_frame_reset_fields(f);
    tdm_error_clear(why);
    layout->header = router ? 1 : 0;
    layout->body = SIZE_MAX;
    layout->first_data = 0;
    if (n_parts > n_total)
        n_parts = n_total;

    /* Before the header decodes nothing can be answered: every refusal is a drop. */
    if (router) {
        if (n_parts < 1 || parts[0].len == 0 || parts[0].len > TDM_NET_PEER_MAX) {
            tdm_error_set(why, TDM_EINVALID, "routing id of %zu bytes (1..%u allowed)",
                          n_parts ? parts[0].len : 0, TDM_NET_PEER_MAX);
            return TDM_NET_DROP;
        }
        memcpy(f->peer, parts[0].ptr, parts[0].len);
        f->peer_len = parts[0].len;
    }
    size_t h = layout->header;
    if (n_parts <= h) {
        tdm_error_set(why, TDM_EINVALID, "message without a FrameHeader");
        return TDM_NET_DROP;
    }
    if (parts[h].len > TDM_NET_MAX_HEADER_BYTES) {
        tdm_error_set(why, TDM_ERESOURCE, "FrameHeader of %zu bytes exceeds the limit of %u bytes",
                      parts[h].len, TDM_NET_MAX_HEADER_BYTES);
        return TDM_NET_DROP;
    }
    int32_t wire_status;
    uint32_t n_data;
    size_t key_len;
    if (!header_decode(&parts[h], f, &wire_status, &n_data, &key_len, why))
        return TDM_NET_DROP;
    tdm_net_verdict_t v = header_check(f, wire_status, key_len, why);
    if (v != TDM_NET_ACCEPT)
        return v;
    return parts_check(parts, n_parts, n_total, h, n_data, f, layout, why);
}

ProtobufCMessage *tdm_frame_unpack(const tdm_frame_t *f, const ProtobufCMessageDescriptor *desc)
{
    if (!f || !desc)
        return NULL;
    const uint8_t *p = f->body ? f->body : net_empty_bytes;
    size_t n = f->body ? f->body_len : 0;
    return protobuf_c_message_unpack(desc, NULL, n, p);
}

bool tdm_frame_expired(const tdm_frame_t *f, uint64_t now_ms)
{
    return f->deadline_unix_ms != 0 && now_ms >= f->deadline_unix_ms;
}

uint64_t tdm_net_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* The enum value's proto name without its prefix ("METHOD_GENERATE" -> "GENERATE"). */
static const char *enum_short_name(const ProtobufCEnumDescriptor *d, int value, const char *prefix)
{
    const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(d, value);
    if (!v)
        return "?";
    size_t n = strlen(prefix);
    return strncmp(v->name, prefix, n) == 0 ? v->name + n : v->name;
}

const char *tdm_net_method_name(int method)
{
    return enum_short_name(&tandem__v1__method__descriptor, method, "METHOD_");
}

const char *tdm_net_kind_name(int kind)
{
    return enum_short_name(&tandem__v1__frame_kind__descriptor, kind, "FRAME_KIND_");
}

size_t tdm_net_text_fit(const char *s, size_t cap)
{
    return text_fit(s, cap);
}
