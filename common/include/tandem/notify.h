/* notify.h - telling a service manager (systemd) how a daemon is doing: sd_notify(3).
 *
 * The units in deploy/systemd are Type=notify: a daemon sends READY=1 once it serves (the
 * router after binding its sockets, a node once the router acknowledged its registration),
 * STATUS=<one line> as it goes and STOPPING=1 when it begins to shut down. The messages go to
 * the datagram socket named by $NOTIFY_SOCKET; without that variable (not started by systemd,
 * or a unit of another type) nothing is sent. Builds without libsystemd (cmake/TandemDeps.cmake)
 * compile these functions as no-ops.
 */
#ifndef TANDEM_NOTIFY_H
#define TANDEM_NOTIFY_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Whether this build can notify a service manager (it was built with libsystemd). */
bool tdm_notify_supported(void);

/* Whether notifications go anywhere: supported, and $NOTIFY_SOCKET is set and not empty. */
bool tdm_notify_enabled(void);

/* Sends `state`, newline-separated VARIABLE=value assignments ("READY=1\nSTATUS=serving"; see
 * sd_notify(3)), to the service manager. Returns 0 when it was sent or when there is no one to
 * send it to (see tdm_notify_enabled); TDM_EUNAVAILABLE when sending failed (bad
 * $NOTIFY_SOCKET, socket gone); TDM_EINVALID for a NULL or empty state. Thread-safe (keeps no
 * state); a failure is for the caller to log, never a reason to stop serving. */
int tdm_notify_send(const char *state);

/* tdm_notify_send with a printf-style format; the text is cut at 1023 bytes. */
int tdm_notify_sendf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_NOTIFY_H */
