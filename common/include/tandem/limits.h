/* limits.h - limits and defaults that the router, the nodes and the client must agree on.
 *
 * Each value is defined here once; base.h includes this header, so every module sees it.
 * A second definition elsewhere would drift (one did: the router allowed 127-byte ids while
 * the nodes' buffers held 128 with the NUL).
 */
#ifndef TANDEM_LIMITS_H
#define TANDEM_LIMITS_H

#ifdef __cplusplus
extern "C" {
#endif

/* Longest request id, bytes, NUL excluded. The router refuses longer ids (request.c); the
 * worker, the node daemons and the KV transfer keep ids in TDM_REQUEST_ID_MAX + 1 byte
 * buffers (worker.h, node.h, transfer.h). */
#define TDM_REQUEST_ID_MAX 127u

/* Longest model name a request may give, bytes (printable UTF-8, tdm_text_printable). The
 * router refuses longer or unprintable names before they reach a message (validate.c). */
#define TDM_MODEL_NAME_MAX 256u

/* Longest constraint text a GENERATE may carry, bytes: a regular expression, and anything
 * else (a JSON Schema, a grammar, a choice list). The router refuses longer ones before it
 * compiles them (validate.c); the HTTP gateway's budgets stay within them (router/http.h). */
#define TDM_CONSTRAINT_MAX_REGEX_BYTES (16u << 10)
#define TDM_CONSTRAINT_MAX_BYTES (1u << 20)

/* Most stop strings per request and the longest one, bytes. The router refuses more
 * (request.c); the client library and the tandem tool check before sending (client_start.c,
 * cmd_generate.c, cmd_chat.c). */
#define TDM_MAX_STOP_STRINGS 16u
#define TDM_MAX_STOP_STRING_BYTES 256u

/* Heartbeat period and the silence after which a peer counts as down, milliseconds. The
 * router sends them in RegisterAck (router.c); a node uses them until the first ack
 * arrives (node/link.c). */
#define TDM_HEARTBEAT_INTERVAL_MS 250u
#define TDM_HEARTBEAT_TIMEOUT_MS 2500u

/* Sequences a node's worker queues behind its max_running running ones (node/runtime.c);
 * the prefill and decode daemons size their per-request tables for max_running plus this
 * many (prefill.c, decode.c). */
#define TDM_NODE_MAX_WAITING 4096u

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_LIMITS_H */
