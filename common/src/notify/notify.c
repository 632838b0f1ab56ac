/* notify.c - sd_notify(3) for the daemons (tandem/notify.h); no-ops without libsystemd. */
#include "tandem/notify.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "tandem/base.h"

#ifdef TANDEM_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

bool tdm_notify_supported(void)
{
#ifdef TANDEM_HAVE_SYSTEMD
    return true;
#else
    return false;
#endif
}

bool tdm_notify_enabled(void)
{
    const char *sock = getenv("NOTIFY_SOCKET");
    return tdm_notify_supported() && sock && sock[0];
}

int tdm_notify_send(const char *state)
{
    if (!state || !state[0])
        return TDM_EINVALID;
#ifdef TANDEM_HAVE_SYSTEMD
    /* > 0: sent; 0: no $NOTIFY_SOCKET; < 0: -errno. unset_environment stays 0 so later
     * messages (STATUS=, STOPPING=1) reach the manager too. */
    return sd_notify(0, state) < 0 ? TDM_EUNAVAILABLE : TDM_OK;
#else
    return TDM_OK;
#endif
}

int tdm_notify_sendf(const char *fmt, ...)
{
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (n < 0)
        return TDM_EINVALID;
    return tdm_notify_send(buf);
}
