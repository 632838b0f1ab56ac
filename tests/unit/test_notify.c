/* test_notify.c - sd_notify for the daemons (tandem/notify.h): what reaches a $NOTIFY_SOCKET
 * listener, byte for byte, and the errors. In a build without libsystemd the functions must
 * send nothing and still return 0. */
#include "tdm_test.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "tandem/base.h"
#include "tandem/notify.h"

typedef struct listener {
    char dir[64];
    char path[96]; /* fits sockaddr_un.sun_path */
    int fd;
} listener_t;

/* Binds a datagram socket in a fresh temporary folder and points $NOTIFY_SOCKET at it. */
static void listener_open(listener_t *l)
{
    snprintf(l->dir, sizeof l->dir, "/tmp/tdm-notify-XXXXXX");
    assert_non_null(mkdtemp(l->dir));
    snprintf(l->path, sizeof l->path, "%s/notify", l->dir);
    l->fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    assert_true(l->fd >= 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    memcpy(sa.sun_path, l->path, strlen(l->path) + 1);
    assert_int_equal(bind(l->fd, (struct sockaddr *)&sa, sizeof sa), 0);
    assert_int_equal(setenv("NOTIFY_SOCKET", l->path, 1), 0);
}

static void listener_close(listener_t *l)
{
    close(l->fd);
    unlink(l->path);
    rmdir(l->dir);
    unsetenv("NOTIFY_SOCKET");
}

/* The next datagram as a string (buf[cap]); -1 when none is waiting. */
static ssize_t listener_recv(listener_t *l, char *buf, size_t cap)
{
    ssize_t n = recv(l->fd, buf, cap - 1, MSG_DONTWAIT);
    if (n >= 0)
        buf[n] = '\0';
    return n;
}

static void test_no_socket(void **state)
{
    (void)state;
    unsetenv("NOTIFY_SOCKET");
    assert_false(tdm_notify_enabled());
    assert_int_equal(tdm_notify_send("READY=1"), TDM_OK); /* nobody listens: not an error */
    assert_int_equal(tdm_notify_sendf("STATUS=%d", 1), TDM_OK);
    assert_int_equal(tdm_notify_send(NULL), TDM_EINVALID);
    assert_int_equal(tdm_notify_send(""), TDM_EINVALID);
    setenv("NOTIFY_SOCKET", "", 1);
    assert_false(tdm_notify_enabled());
    unsetenv("NOTIFY_SOCKET");
}

static void test_messages(void **state)
{
    (void)state;
    listener_t l;
    listener_open(&l);
    char buf[2048];
    assert_int_equal(tdm_notify_send("READY=1\nSTATUS=serving"), TDM_OK);
    assert_int_equal(tdm_notify_sendf("STATUS=%s %d", "registering with", 7601), TDM_OK);
    if (!tdm_notify_supported()) {
        /* Built without libsystemd (cmake/TandemDeps.cmake): a no-op. */
        assert_false(tdm_notify_enabled());
        assert_int_equal(listener_recv(&l, buf, sizeof buf), -1);
        print_message("built without libsystemd: checked that nothing is sent\n");
        listener_close(&l);
        return;
    }
    assert_true(tdm_notify_enabled());
    assert_int_equal(listener_recv(&l, buf, sizeof buf), 22);
    assert_string_equal(buf, "READY=1\nSTATUS=serving");
    assert_true(listener_recv(&l, buf, sizeof buf) > 0);
    assert_string_equal(buf, "STATUS=registering with 7601");
    assert_int_equal(listener_recv(&l, buf, sizeof buf), -1);

    /* The variable stays set: later messages (STOPPING=1) go out too. */
    assert_non_null(getenv("NOTIFY_SOCKET"));
    assert_int_equal(tdm_notify_send("STOPPING=1"), TDM_OK);
    assert_true(listener_recv(&l, buf, sizeof buf) > 0);
    assert_string_equal(buf, "STOPPING=1");

    /* A long STATUS is cut at 1023 bytes, not dropped. */
    char lng[1500];
    memset(lng, 'x', sizeof lng - 1);
    lng[sizeof lng - 1] = '\0';
    assert_int_equal(tdm_notify_sendf("STATUS=%s", lng), TDM_OK);
    assert_int_equal(listener_recv(&l, buf, sizeof buf), 1023);
    assert_memory_equal(buf, "STATUS=xxx", 10);
    listener_close(&l);
}

static void test_socket_gone(void **state)
{
    (void)state;
    listener_t l;
    listener_open(&l);
    close(l.fd);
    unlink(l.path);
    /* Nobody at the path: the send fails, which the daemons log and ignore. */
    assert_int_equal(tdm_notify_send("READY=1"),
                     tdm_notify_supported() ? TDM_EUNAVAILABLE : TDM_OK);
    rmdir(l.dir);
    unsetenv("NOTIFY_SOCKET");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_socket),
        cmocka_unit_test(test_messages),
        cmocka_unit_test(test_socket_gone),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
