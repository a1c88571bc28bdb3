/* The library's version, exported so tools can tell which shim a process carries. */
#define MS_EXPORT __attribute__((visibility("default")))

MS_EXPORT const char *mpsshim_version(void);

MS_EXPORT const char *mpsshim_version(void) { return "0.1.0"; }
