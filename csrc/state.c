/* Configuration from the environment (see state.h), read once under pthread_once. */
#include "state.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "hooks.h"
#include "log.h"

#define LIMIT_VAR "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
#define MPSD_DEVICE_PREFIX "MPSD_DEVICE_"
#define MPSD_DEVICE_HEX 16 /* mpsd/dra/cdi.py device_marker */

extern char **environ;

static ms_state g_state;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_disabled = -1;

static int parse_bool(const char *text, int *out)
{
    static const char *const yes[] = {"1", "true", "yes", "on"};
    static const char *const no[] = {"", "0", "false", "no", "off"};
    for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++)
        if (strcasecmp(text, yes[i]) == 0)
            return *out = 1, 0;
    for (size_t i = 0; i < sizeof no / sizeof no[0]; i++)
        if (strcasecmp(text, no[i]) == 0)
            return *out = 0, 0;
    return -1;
}

int ms_disabled(void)
{
    int d = __atomic_load_n(&g_disabled, __ATOMIC_RELAXED);
    if (d >= 0)
        return d;
    const char *text = getenv("MPSSHIM_DISABLE");
    d = 0;
    if (text != NULL && parse_bool(text, &d) != 0) {
        d = 0; /* keep the caps: a typo must not switch enforcement off */
        ms_log(MS_LOG_ERROR, "MPSSHIM_DISABLE=\"%s\" is not one of 1/0/true/false/yes/no/on/off; caps stay on",
               text);
    }
    __atomic_store_n(&g_disabled, d, __ATOMIC_RELAXED);
    return d;
}

int ms_caps_reported(void)
{
    if (ms_disabled())
        return 0;
    const ms_state *s = ms_state_get();
    return !s->limits_bad && s->limits.count > 0;
}

/* 1 if the path was named in MPSSHIM_REGION (a region shared by the container's processes,
 * created 0666 so every UID among them can join), 0 for the per-UID default (umask applies). */
int ms_region_path(char *buf, size_t len)
{
    const char *env = getenv("MPSSHIM_REGION");
    if (env != NULL && env[0] != '\0') {
        snprintf(buf, len, "%s", env);
        return 1;
    }
    snprintf(buf, len, "/tmp/mpsshim-%u.region", (unsigned)getuid());
    return 0;
}

static void init_log_level(void)
{
    const char *text = getenv("MPSSHIM_LOG");
    if (text == NULL || text[0] == '\0')
        return;
    int level = ms_log_parse_level(text);
    if (level < 0)
        ms_log(MS_LOG_WARN, "MPSSHIM_LOG=\"%s\" is not 0..3 or error/warn/info/debug; using warn", text);
    else
        ms_log_set_level(level);
}

/* MPSD_DEVICE_, 16 upper-case hex digits and '=' (mpsd/dra/cdi.py device_marker): the device
 * the entry names; NULL for any other entry (mpsd's own MPSD_DEVICE_PLUGIN setting among them). */
static const char *device_marker_value(const char *entry)
{
    const size_t prefix = sizeof MPSD_DEVICE_PREFIX - 1;
    if (strncmp(entry, MPSD_DEVICE_PREFIX, prefix) != 0)
        return NULL;
    for (size_t i = prefix; i < prefix + MPSD_DEVICE_HEX; i++)
        if (!((entry[i] >= '0' && entry[i] <= '9') || (entry[i] >= 'A' && entry[i] <= 'F')))
            return NULL;
    return entry[prefix + MPSD_DEVICE_HEX] == '=' ? entry + prefix + MPSD_DEVICE_HEX + 1 : NULL;
}

/* mpsd's DRA CDI devices each set a marker (above). A container given two of them (a whole claim
 * of two requests, or two claims) gets one device's limits, thread percentage and region from the
 * runtime's merge, and its other GPUs no cap at all: the number of them, and their names in
 * ``names``. */
static int mpsd_devices(char *names, size_t len)
{
    int n = 0;
    size_t used = 0;
    names[0] = '\0';
    for (char **e = environ; e != NULL && *e != NULL; e++) {
        const char *device = device_marker_value(*e);
        if (device == NULL)
            continue;
        n++;
        if (used < len) {
            int w = snprintf(names + used, len - used, "%s%s", n > 1 ? ", " : "", device);
            used = w < 0 ? len : used + (size_t)w;
        }
    }
    return n;
}

static void init_once(void)
{
    ms_state *s = &g_state;
    init_log_level();
    char devices[512];
    int ndevices = mpsd_devices(devices, sizeof devices);
    if (ndevices > 1) {
        s->limits_bad = 1;
        s->limits.count = 0;
        ms_log(MS_LOG_ERROR,
               "this container has %d mpsd devices (%s); a container may name one request of one mpsd "
               "claim (docs/dra.md): cuInit fails with CUDA_ERROR_INVALID_VALUE and every allocation is refused",
               ndevices, devices);
        return;
    }
    const char *text = getenv(LIMIT_VAR);
    if (text != NULL && text[0] != '\0') {
        char err[256];
        if (ms_parse_limits(text, &s->limits, err, sizeof err) != 0) {
            s->limits_bad = 1;
            s->limits.count = 0;
            ms_log(MS_LOG_ERROR,
                   LIMIT_VAR "=\"%.200s\" is malformed (%s); cuInit fails with CUDA_ERROR_INVALID_VALUE "
                             "and every allocation is refused",
                   text, err);
            return;
        }
    }
    for (int i = 0; i < s->limits.count; i++)
        if (s->limits.item[i].ordinal < 0)
            s->limits_by_uuid = 1;
    if (s->limits.count == 0) {
        ms_log(MS_LOG_INFO, "no memory caps (" LIMIT_VAR " unset or empty): allocations pass through");
        return;
    }
    int named = ms_region_path(s->region_path, sizeof s->region_path);
    if (named && s->region_path[0] != '/') { /* each working directory would get a cap of its own */
        s->limits_bad = 1;
        s->limits.count = 0;
        ms_log(MS_LOG_ERROR,
               "MPSSHIM_REGION=\"%.200s\" is not an absolute path; cuInit fails with CUDA_ERROR_INVALID_VALUE "
               "and every allocation is refused",
               s->region_path);
        return;
    }
    /* Named: 0666, shared by the container's UIDs. The per-UID default sits in a /tmp others
     * can write: a file there that this UID does not own (or a link, a FIFO) is refused. */
    unsigned mode = named ? 0666u : MS_MODE_UMASK, flags = named ? 0u : MS_OPEN_OWNED;
    char err[512];
    if (ms_region_open_ex(s->region_path, mode, flags, &s->region, err, sizeof err) != 0) {
        s->region = NULL;
        ms_log(MS_LOG_ERROR,
               "accounting region \"%s\" is unusable (%s); allocations on capped devices are refused "
               "(set MPSSHIM_REGION to a writable file path)",
               s->region_path, err);
        return;
    }
    ms_log(MS_LOG_INFO, "%d memory cap(s) from " LIMIT_VAR "=\"%.200s\", region %s", s->limits.count, text,
           s->region_path);
}

/* Set once init_once has run: the hot path then reads one word instead of calling pthread_once. */
static const ms_state *g_ready;

const ms_state *ms_state_get(void)
{
    const ms_state *s = __atomic_load_n(&g_ready, __ATOMIC_ACQUIRE);
    if (s != NULL)
        return s;
    pthread_once(&g_once, init_once);
    __atomic_store_n(&g_ready, &g_state, __ATOMIC_RELEASE);
    return &g_state;
}

void ms_format_uuid(const unsigned char b[16], const char *prefix, char *out, size_t len)
{
    snprintf(out, len,
             "%s-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", prefix, b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
}

/* Per-device cache of the cap decision: 0 unknown, 1 uncapped, 2 capped (g_cap valid). */
static int g_cap_state[MS_MAX_DEVICES];
static uint64_t g_cap[MS_MAX_DEVICES];

static int device_uuid(int dev, unsigned char bytes[16])
{
    CUuuid u;
    ms_cuDeviceGetUuid_fn get = (ms_cuDeviceGetUuid_fn)ms_real_fn(MS_ID_cuDeviceGetUuid_v2);
    if (get == NULL)
        get = (ms_cuDeviceGetUuid_fn)ms_real_fn(MS_ID_cuDeviceGetUuid);
    if (get == NULL)
        return -1;
    CUresult rc = get(&u, dev);
    if (rc != CUDA_SUCCESS) {
        ms_log(MS_LOG_WARN, "cuDeviceGetUuid(%d) failed with %d: cannot tell whether device %d is capped", dev, rc,
               dev);
        return -1;
    }
    memcpy(bytes, u.bytes, 16);
    return 0;
}

int ms_cap_of_device(int dev, uint64_t *cap)
{
    const ms_state *s = ms_state_get();
    if (s->limits.count == 0)
        return 0;
    if (dev < 0 || dev >= MS_MAX_DEVICES)
        return -1;
    int st = __atomic_load_n(&g_cap_state[dev], __ATOMIC_ACQUIRE);
    if (st == 1)
        return 0;
    if (st == 2) {
        *cap = g_cap[dev];
        return 1;
    }
    int found = 0;
    uint64_t bytes = 0;
    if (!s->limits_by_uuid) {
        found = ms_limits_find(&s->limits, dev, NULL, &bytes);
    } else {
        unsigned char u[16];
        if (device_uuid(dev, u) != 0)
            return -1; /* not cached: the next call asks again */
        char text[64];
        ms_format_uuid(u, "GPU", text, sizeof text);
        found = ms_limits_find(&s->limits, dev, text, &bytes);
        if (!found) {
            ms_format_uuid(u, "MIG", text, sizeof text);
            found = ms_limits_find(&s->limits, dev, text, &bytes);
        }
    }
    if (found) {
        g_cap[dev] = bytes;
        __atomic_store_n(&g_cap_state[dev], 2, __ATOMIC_RELEASE);
        *cap = bytes;
        return 1;
    }
    __atomic_store_n(&g_cap_state[dev], 1, __ATOMIC_RELEASE);
    return 0;
}
