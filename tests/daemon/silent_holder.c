/* Connects to the unix SOCK_SEQPACKET socket argv[1], sends nothing, and holds the connection
 * until its stdin ends: a session on the MPS control daemon that is never used. Built by
 * tests/daemon/test_control_plane.py to run inside a container (no Python there). */
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

int main(int argc, char **argv) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    char buf[64];
    int fd;
    if (argc != 2 || strlen(argv[1]) >= sizeof addr.sun_path) {
        fprintf(stderr, "usage: silent_holder SOCKET\n");
        return 2;
    }
    strcpy(addr.sun_path, argv[1]);
    fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        perror("silent_holder");
        return 1;
    }
    printf("held\n");
    fflush(stdout);
    while (read(0, buf, sizeof buf) > 0) {
    }
    close(fd);
    return 0;
}
