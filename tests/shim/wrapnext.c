/* A preloaded wrapper of puts() that finds the next puts with dlsym(RTLD_NEXT), as profilers
 * and other interposers do. Loaded after libmpsshim.so, it recurses forever unless the shim's
 * dlsym override resolves RTLD_NEXT relative to this library, not to the shim. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>

int puts(const char *s)
{
    static int (*next)(const char *);
    if (next == NULL)
        next = (int (*)(const char *))dlsym(RTLD_NEXT, "puts");
    if (next == NULL || next == puts)
        return -1;
    write(1, "wrapped:", 8);
    return next(s);
}
