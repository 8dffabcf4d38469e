/*
 * The lab cluster's Pod sandbox process (`cargo xtask cluster`): it holds a Pod's namespaces
 * open and does nothing else. As PID 1 of the sandbox it also reaps orphans, and it exits at
 * once on SIGINT or SIGTERM. Built statically by xtask/src/testimages.rs into the image named
 * registry.k8s.io/pause:<tag of the pinned release>, since nothing can be pulled here.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) {
    (void)sig;
    _exit(0);
}

static void on_child(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "-v") == 0) {
        puts("kube-ipvs lab pause");
        return 0;
    }
    if (getpid() != 1) {
        fprintf(stderr, "pause: not PID 1; orphans will not be reaped\n");
    }
    struct sigaction stop = {.sa_handler = on_stop};
    struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};
    if (sigaction(SIGINT, &stop, NULL) || sigaction(SIGTERM, &stop, NULL) ||
        sigaction(SIGCHLD, &child, NULL)) {
        perror("pause: sigaction");
        return 1;
    }
    for (;;) {
        pause();
    }
}
