/* A CUDA client as the MPS control daemon sees it, up to the point where the daemon answers:
 * it maps a CUDA driver (argv[2], the fake libcuda.so.1 of tests/fakes), connects to
 * argv[1] (PIPE_DIR/control), and introduces itself the way the driver's MPS client code does,
 * seen with strace on the real 535 daemon: the daemon sends "OUTBHELL\0"; the client answers
 * "OUTBCRED\0" and then its connection type as a 4-byte int (2 = client; the UI front-end
 * sends 4), each with its SCM_CREDENTIALS. The daemon then logs "NEW CLIENT <pid> from user
 * <uid>: ..." and keeps the connection until it can name a server. This client then holds the
 * connection until its stdin ends (it never reads the answer: no GPU, no real server).
 * Built by tests/daemon/test_multiuser.py; no Python, so it runs as any UID and in a
 * container. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static int send_with_credentials(int fd, const void *data, size_t len) {
    struct ucred cred = {.pid = getpid(), .uid = getuid(), .gid = getgid()};
    char control[CMSG_SPACE(sizeof cred)];
    struct iovec iov = {.iov_base = (void *)data, .iov_len = len};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                         .msg_controllen = sizeof control};
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    memset(control, 0, sizeof control);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_CREDENTIALS;
    cmsg->cmsg_len = CMSG_LEN(sizeof cred);
    memcpy(CMSG_DATA(cmsg), &cred, sizeof cred);
    return sendmsg(fd, &msg, 0) == (ssize_t)len ? 0 : -1;
}

int main(int argc, char **argv) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    const int client = 2;
    char buf[64];
    ssize_t got;
    int fd;
    if (argc != 3 || strlen(argv[1]) >= sizeof addr.sun_path) {
        fprintf(stderr, "usage: pending_client CONTROL_SOCKET LIBCUDA\n");
        return 2;
    }
    if (dlopen(argv[2], RTLD_NOW | RTLD_GLOBAL) == NULL) {
        fprintf(stderr, "pending_client: %s\n", dlerror());
        return 1;
    }
    strcpy(addr.sun_path, argv[1]);
    fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        perror("pending_client: connect");
        return 1;
    }
    memset(buf, 0, sizeof buf);
    got = recv(fd, buf, sizeof buf - 1, 0);
    if (got <= 0 || strcmp(buf, "OUTBHELL") != 0) {
        fprintf(stderr, "pending_client: no hello from the daemon: recv returned %zd (%s), \"%.*s\"\n", got,
                got < 0 ? strerror(errno) : got == 0 ? "closed" : "data", got > 0 ? (int)got : 0, buf);
        return 1;
    }
    if (send_with_credentials(fd, "OUTBCRED", 9) != 0 || send_with_credentials(fd, &client, sizeof client) != 0) {
        perror("pending_client: send");
        return 1;
    }
    printf("pending %d\n", (int)getpid());
    fflush(stdout);
    while (read(0, buf, sizeof buf) > 0) {
    }
    close(fd);
    return 0;
}
