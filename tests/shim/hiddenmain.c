/* Runs the runtime's sequence against hiddendriver.c: cuGetProcAddress_v2 for itself, then
 * cuInit and BASE (cuMemAlloc or cuMemAllocAsync) at ABI VERSION with FLAGS, then
 * allocations of the given sizes. Prints "init=RC alloc=RC,RC,... calls=N ptsz=N".
 * Usage: hiddenmain VERSION FLAGS BASE SIZE... */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*gpa2_fn)(const char *, void **, int, unsigned long long, int *);

int main(int argc, char **argv)
{
    if (argc < 4)
        return 2;
    int version = atoi(argv[1]);
    unsigned long long flags = strtoull(argv[2], NULL, 0);
    const char *base = argv[3];
    int async = strcmp(base, "cuMemAllocAsync") == 0;
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    gpa2_fn first = h ? (gpa2_fn)dlsym(h, "cuGetProcAddress_v2") : NULL;
    unsigned long long (*calls)(void) = h ? (unsigned long long (*)(void))dlsym(h, "hidden_calls") : NULL;
    unsigned long long (*calls_ptsz)(void) = h ? (unsigned long long (*)(void))dlsym(h, "hidden_calls_ptsz") : NULL;
    void *self = NULL, *init = NULL, *alloc = NULL;
    int status = 0;
    if (first == NULL || calls == NULL || calls_ptsz == NULL || first("cuGetProcAddress", &self, 12000, 0, &status) != 0 || self == NULL)
        return 3;
    gpa2_fn gpa2 = (gpa2_fn)self;
    if (gpa2("cuInit", &init, version, 0, &status) != 0 || gpa2(base, &alloc, version, flags, &status) != 0 ||
        init == NULL || alloc == NULL)
        return 4;
    printf("init=%d alloc=", ((int (*)(unsigned))init)(0));
    for (int i = 4; i < argc; i++) {
        unsigned long long p = 0, n = strtoull(argv[i], NULL, 0);
        int rc = async ? ((int (*)(unsigned long long *, size_t, void *))alloc)(&p, n, NULL)
                       : ((int (*)(unsigned long long *, size_t))alloc)(&p, n);
        printf("%s%d", i > 4 ? "," : "", rc);
    }
    printf(" calls=%llu ptsz=%llu\n", calls(), calls_ptsz());
    return 0;
}
