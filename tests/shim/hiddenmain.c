/* Runs the runtime's sequence against hiddendriver.c: cuGetProcAddress_v2 for itself, then
 * cuInit and cuMemAlloc at ABI VERSION, then allocations of the given sizes. Prints
 * "init=RC alloc=RC,RC,... calls=N". */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

typedef int (*gpa2_fn)(const char *, void **, int, unsigned long long, int *);

int main(int argc, char **argv)
{
    if (argc < 2)
        return 2;
    int version = atoi(argv[1]);
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    gpa2_fn first = h ? (gpa2_fn)dlsym(h, "cuGetProcAddress_v2") : NULL;
    unsigned long long (*calls)(void) = h ? (unsigned long long (*)(void))dlsym(h, "hidden_calls") : NULL;
    void *self = NULL, *init = NULL, *alloc = NULL;
    int status = 0;
    if (first == NULL || calls == NULL || first("cuGetProcAddress", &self, 12000, 0, &status) != 0 || self == NULL)
        return 3;
    gpa2_fn gpa2 = (gpa2_fn)self;
    if (gpa2("cuInit", &init, version, 0, &status) != 0 || gpa2("cuMemAlloc", &alloc, version, 0, &status) != 0 ||
        init == NULL || alloc == NULL)
        return 4;
    printf("init=%d alloc=", ((int (*)(unsigned))init)(0));
    for (int i = 2; i < argc; i++) {
        unsigned long long p = 0;
        printf("%s%d", i > 2 ? "," : "", ((int (*)(unsigned long long *, size_t))alloc)(&p, strtoull(argv[i], NULL, 0)));
    }
    printf(" calls=%llu\n", calls());
    return 0;
}
