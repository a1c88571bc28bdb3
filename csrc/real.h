/* Finding the real driver functions without loading the driver into processes that do not
 * use it: a library already loaded is found with dlopen(RTLD_NOLOAD), then RTLD_NEXT; only a
 * hook that is actually called loads it for real. glibc's own dlsym is reached with dlvsym,
 * because the shim overrides dlsym (procaddr.c). */
#ifndef MPSSHIM_REAL_H
#define MPSSHIM_REAL_H

typedef enum ms_lib { MS_LIB_CUDA = 0, MS_LIB_NVML = 1, MS_LIB_COUNT } ms_lib;

typedef void *(*ms_dlsym_fn)(void *handle, const char *name);

/* Code that runs inside dlsym(RTLD_NEXT) may run before a sanitizer runtime is initialised
 * (it looks its interceptors up that way): keep it uninstrumented in sanitizer builds. */
#define MS_NO_SANITIZE __attribute__((no_sanitize("address", "undefined", "thread")))

/* glibc's dlsym (never NULL once found; NULL only if glibc offers none of the known versions). */
MS_NO_SANITIZE ms_dlsym_fn ms_real_dlsym(void);

/* The library's handle if it is loaded (NOLOAD; the shim keeps the reference it takes, so
 * a handle once seen stays valid), or, with load != 0, after loading it. NULL if neither. */
void *ms_lib_handle(ms_lib lib, int load);

/* The library's own definition of `name`; loads the library only if load != 0. */
void *ms_real_lookup(ms_lib lib, const char *name, int load);

/* 1 if code address `addr` lies inside the loaded library `lib`. */
int ms_addr_in_lib(ms_lib lib, const void *addr);

#endif
