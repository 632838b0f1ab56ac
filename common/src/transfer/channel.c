/* channel.c - a KV sender's channels, one per receiver endpoint: a DEALER socket opened on
 * first use (CURVE: authenticating the receiver's key), reset when its receiver is lost, times
 * out or changes key, and watched for a failed handshake or a lost connection, after which
 * tcp transfers are sent again on a new connection (the device backends fail them at once).
 */
#include "transfer/transfer_internal.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

/* A transfer whose connection was lost is sent again on a new one at most this many times
 * (tcp backend), within its timeout, and only when the new connection's handshake succeeds
 * within TDM_KV_RESEND_CONNECT_S: a receiver that does not answer that fast is taken to be
 * gone or cut off, and the transfer fails as before (the router re-dispatches it). */
#define TDM_KV_MAX_RESENDS 2u
#define TDM_KV_RESEND_CONNECT_S 2.0
#define TDM_KV_RESEND_CONNECT_TEXT "2 s"

void tdm_kv_channel_drop_comm(tdm_kv_sender_t *s, tdm_kv_channel_t *ch)
{
#ifdef TANDEM_HAVE_CUDA
    tdm_kv_dev_channel_drop_comm(ch);
    for (tdm_kv_xfer_t *x = s->xfers; x; x = x->next)
        if (x->ch == ch)
            x->go = false; /* the receiver's side of the communicator is gone as well */
#else
    (void)s;
    (void)ch;
#endif
}

void tdm_kv_channel_reset(tdm_kv_sender_t *s, tdm_kv_channel_t *ch, const char *why)
{
    for (tdm_kv_xfer_t *x = s->xfers; x; x = x->next)
        if (x->ch == ch && !x->finished)
            tdm_kv_xfer_finish(x, TDM_EUNAVAILABLE, "channel to %s reset: %s", ch->endpoint, why);
    TDM_LOG_WARNF(s->log, NULL, "KV channel to %s reset: %s", ch->endpoint, why);
    tdm_sock_destroy(&ch->sock);
    ch->generation++;
    ch->resend_by = 0;
    tdm_kv_channel_drop_comm(s, ch);
}

/* Opens ch's socket to its endpoint (a DEALER watching its handshakes and connection; CURVE
 * with the receiver key of the channel or the sender). Returns 0, or the error of
 * tdm_sock_connect with *err naming the endpoint. */
static int channel_open(tdm_kv_sender_t *s, tdm_kv_channel_t *ch, tdm_error_t *err)
{
    tdm_sock_opts_t o;
    memset(&o, 0, sizeof o);
    /* CURVE: the sender's own pair, and the receiver's key given with the transfer (each
     * decode node has its own pair), else the one the sender was made with */
    tdm_curve_keys_t curve = s->curve;
    if (ch->server_key[0])
        curve.server_public = ch->server_key;
    o.curve = s->has_curve ? &curve : NULL;
    /* the monitor makes a key mismatch, and a connection lost (peer gone, cut, or silent past
     * the ZMTP heartbeat timeout), fail the transfers at once instead of at their timeout */
    o.watch_handshake = true;
    o.log = s->log;
    ch->disconnects = 0;
    ch->resend_by = 0;
    ch->sock = tdm_sock_connect(s->net, ch->endpoint, &o, err);
    if (!ch->sock)
        return tdm_error_prefix(err, err ? err->code : TDM_EUNAVAILABLE,
                                "opening the KV channel to %s: ", ch->endpoint);
    return 0;
}

tdm_kv_channel_t *tdm_kv_channel_get(tdm_kv_sender_t *s, const char *endpoint,
                                     const char *server_key, tdm_error_t *err)
{
    tdm_kv_channel_t *ch = s->channels;
    while (ch && strcmp(ch->endpoint, endpoint) != 0)
        ch = ch->next;
    if (!ch) {
        if (s->n_channels + 2 > s->poll_cap) {
            uint32_t cap = s->poll_cap ? s->poll_cap * 2 : 8;
            void *items = realloc(s->poll_items, cap * sizeof(zmq_pollitem_t));
            if (!items) {
                tdm_error_set(err, TDM_ERESOURCE, "out of memory for KV channel poll items");
                return NULL;
            }
            s->poll_items = items;
            s->poll_cap = cap;
        }
        ch = calloc(1, sizeof *ch);
        if (ch)
            ch->endpoint = tdm_strdup(endpoint);
        if (!ch || !ch->endpoint) {
            free(ch);
            tdm_error_set(err, TDM_ERESOURCE, "out of memory for a KV channel");
            return NULL;
        }
        ch->next = s->channels;
        s->channels = ch;
        s->n_channels++;
    }
    if (!server_key)
        server_key = "";
    if (strlen(server_key) >= sizeof ch->server_key) {
        tdm_error_set(err, TDM_EINVALID,
                      "KV channel to %s: the receiver's CURVE key is %zu "
                      "characters, not 40",
                      endpoint, strlen(server_key));
        return NULL;
    }
    if (strcmp(ch->server_key, server_key) != 0) {
        if (ch->sock)
            tdm_kv_channel_reset(s, ch, "the receiver's CURVE key changed");
        snprintf(ch->server_key, sizeof ch->server_key, "%s", server_key);
    }
    if (!ch->sock && channel_open(s, ch, err) != 0)
        return NULL;
    return ch;
}

/* CURVE: a channel whose handshake failed never delivers; its transfers fail now, with the
 * reason, instead of at their timeout. */
static void check_handshakes(tdm_kv_sender_t *s)
{
    for (tdm_kv_channel_t *ch = s->channels; ch; ch = ch->next) {
        char why[200];
        if (!ch->sock || tdm_sock_handshake(ch->sock, why, sizeof why) == TDM_OK)
            continue;
        bool any = false;
        for (tdm_kv_xfer_t *x = s->xfers; x; x = x->next)
            if (x->ch == ch && !x->finished) {
                tdm_kv_xfer_finish(x, TDM_EUNAUTHENTICATED,
                                   "cannot authenticate the decode node's KV endpoint %s: %s",
                                   ch->endpoint, why);
                any = true;
            }
        if (any)
            tdm_kv_channel_reset(s, ch, why);
    }
}

/* ch's connection was lost with transfers waiting on it (tcp backend): ZeroMQ does not resend
 * a message cut off mid-way, so each one is sent again, at once, on a new socket, when it has
 * resends and time left (else it fails, UNAVAILABLE, as before); the new connection must
 * complete its handshake within TDM_KV_RESEND_CONNECT_S (check_resends). A transfer
 * whose END was lost on the way back is refused by the receiver the second time (its
 * reservation is in use), which fails it like the connection loss would have. */
static void channel_resend(tdm_kv_sender_t *s, tdm_kv_channel_t *ch, double now)
{
    tdm_sock_destroy(&ch->sock); /* releases the frames the lost connection still held */
    ch->generation++;
    tdm_error_t err = {0};
    if (channel_open(s, ch, &err) != 0) {
        tdm_kv_channel_reset(s, ch, err.msg);
        return;
    }
    ch->resend_by = now + TDM_KV_RESEND_CONNECT_S;
    for (tdm_kv_xfer_t *x = s->xfers; x; x = x->next) {
        if (x->ch != ch || x->finished)
            continue;
        if (x->resends >= TDM_KV_MAX_RESENDS || now >= x->deadline) {
            tdm_kv_xfer_finish(x, TDM_EUNAVAILABLE,
                               "the connection to %s was lost (the transfer was sent %u times)",
                               ch->endpoint, x->resends + 1);
            continue;
        }
        x->resends++;
        x->generation = ch->generation;
        tdm_error_t e = {0};
        if (tdm_kv_xfer_transmit(s, x, &e) != 0)
            tdm_kv_xfer_finish(x, TDM_EUNAVAILABLE,
                               "resending to %s after the connection was lost: %s", ch->endpoint,
                               e.msg);
        else
            TDM_LOG_WARNF(s->log, x->request_id,
                          "KV transfer %" PRIu64 ": the connection to %s was lost; resending "
                          "it (%u of %u)",
                          x->id, ch->endpoint, x->resends, TDM_KV_MAX_RESENDS);
    }
}

/* A channel that sent transfers again after losing its connection: once the new connection's
 * handshake succeeded, nothing more to watch; a receiver that has not completed one by
 * resend_by is gone or cut off, and the transfers fail now instead of at their timeout. */
static void check_resends(tdm_kv_sender_t *s, double now)
{
    for (tdm_kv_channel_t *ch = s->channels; ch; ch = ch->next) {
        if (!ch->sock || ch->resend_by <= 0)
            continue;
        if (tdm_sock_handshakes(ch->sock) > 0)
            ch->resend_by = 0;
        else if (now >= ch->resend_by)
            tdm_kv_channel_reset(s, ch,
                                 "the connection to the receiver was lost and no new one "
                                 "completed its handshake within " TDM_KV_RESEND_CONNECT_TEXT);
    }
}

/* A channel whose connection dropped while transfers were waiting on it: what was in flight
 * may be lost with it (ZeroMQ does not resend a message cut off mid-way, nor an END that was
 * on the way back). tcp: they are sent again at once on a new connection (channel_resend);
 * the device backends fail them now, UNAVAILABLE, and the router retries them at once
 * instead of after the transfer timeout. */
static void check_connections(tdm_kv_sender_t *s, double now)
{
    for (tdm_kv_channel_t *ch = s->channels; ch; ch = ch->next) {
        uint64_t d = ch->sock ? tdm_sock_disconnects(ch->sock) : 0;
        if (!ch->sock || d == ch->disconnects)
            continue;
        ch->disconnects = d;
        bool waiting = false;
        for (tdm_kv_xfer_t *x = s->xfers; x && !waiting; x = x->next)
            waiting = x->ch == ch && !x->finished;
        if (waiting && s->backend == TDM_KV_BACKEND_TCP)
            channel_resend(s, ch, now);
        else if (waiting)
            tdm_kv_channel_reset(s, ch, "the connection to the receiver was lost");
    }
}

void tdm_kv_channels_check(tdm_kv_sender_t *s, double now)
{
    if (s->has_curve)
        check_handshakes(s);
    check_connections(s, now);
    check_resends(s, now);
}

void tdm_kv_channels_free(tdm_kv_sender_t *s)
{
    tdm_kv_channel_t *ch = s->channels;
    while (ch) {
        tdm_kv_channel_t *next = ch->next;
        free(ch->endpoint);
        free(ch);
        ch = next;
    }
    s->channels = NULL;
    s->n_channels = 0;
}
