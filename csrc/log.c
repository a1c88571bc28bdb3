/* The one reporter (see log.h). */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int g_level = MS_LOG_DEFAULT;
static __thread int t_in_log; /* recursion guard: a hook called while formatting is silent */

static const char *const LEVEL_NAMES[] = {"error", "warn", "info", "debug"};

int ms_log_parse_level(const char *text)
{
    if (text == NULL)
        return -1;
    if (text[0] >= '0' && text[0] <= '3' && text[1] == '\0')
        return text[0] - '0';
    for (int i = 0; i < 4; i++)
        if (strcasecmp(text, LEVEL_NAMES[i]) == 0)
            return i;
    return -1;
}

void ms_log_set_level(int level) { __atomic_store_n(&g_level, level, __ATOMIC_RELAXED); }

int ms_log_enabled(int level) { return level <= __atomic_load_n(&g_level, __ATOMIC_RELAXED); }

static void emit(int level, const char *fmt, va_list ap)
{
    char line[1024];
    int n = snprintf(line, sizeof line, "mpsshim[%d]: %s: ", (int)getpid(), LEVEL_NAMES[level]);
    if (n < 0)
        return;
    int m = vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    if (m < 0)
        return;
    size_t len = (size_t)n + (size_t)m;
    if (len > sizeof line - 2)
        len = sizeof line - 2;
    line[len++] = '\n';
    const char *p = line;
    while (len > 0) {
        ssize_t w = write(STDERR_FILENO, p, len);
        if (w <= 0)
            return;
        p += w;
        len -= (size_t)w;
    }
}

static void emitf(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void emitf(int level, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    emit(level, fmt, ap);
    va_end(ap);
}

void ms_log(int level, const char *fmt, ...)
{
    if (level < 0 || level > MS_LOG_DEBUG || !ms_log_enabled(level) || t_in_log)
        return;
    t_in_log = 1;
    va_list ap;
    va_start(ap, fmt);
    emit(level, fmt, ap);
    va_end(ap);
    t_in_log = 0;
}

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

void ms_log_limited(ms_ratelimit *rl, int level, const char *fmt, ...)
{
    if (level < 0 || level > MS_LOG_DEBUG || !ms_log_enabled(level) || t_in_log)
        return;
    long long now = now_ns();
    long long last = __atomic_load_n(&rl->last_ns, __ATOMIC_RELAXED);
    if (last != 0 && now - last < 1000000000LL) {
        __atomic_add_fetch(&rl->suppressed, 1, __ATOMIC_RELAXED);
        return;
    }
    if (!__atomic_compare_exchange_n(&rl->last_ns, &last, now, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
        __atomic_add_fetch(&rl->suppressed, 1, __ATOMIC_RELAXED);
        return;
    }
    unsigned long dropped = __atomic_exchange_n(&rl->suppressed, 0, __ATOMIC_RELAXED);
    t_in_log = 1;
    if (dropped > 0)
        emitf(level, "(%lu similar lines dropped in the last second)", dropped);
    va_list ap;
    va_start(ap, fmt);
    emit(level, fmt, ap);
    va_end(ap);
    t_in_log = 0;
}
