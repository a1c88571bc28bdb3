/* Loads the stand-in driver and prints what the driver's own lookup of cuInit yields and
 * where the program's lookup of cuInit points (the shim's hook). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

int main(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    if (h == NULL)
        return 3;
    int (*own)(void) = (int (*)(void))dlsym(h, "selfdriver_lookup_is_own");
    void *init = dlsym(h, "cuInit");
    Dl_info info;
    if (own == NULL || init == NULL || dladdr(init, &info) == 0)
        return 4;
    const char *file = strrchr(info.dli_fname, '/');
    printf("driver_own=%d program_gets=%s\n", own(), file ? file + 1 : info.dli_fname);
    return 0;
}
