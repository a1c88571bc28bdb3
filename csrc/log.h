/* The shim's one reporter: one line per message on stderr, "mpsshim[PID]: LEVEL: text".
 * Recursion-guarded (a message raised while reporting is dropped) and never allocates. */
#ifndef MPSSHIM_LOG_H
#define MPSSHIM_LOG_H

enum { MS_LOG_ERROR = 0, MS_LOG_WARN = 1, MS_LOG_INFO = 2, MS_LOG_DEBUG = 3 };
#define MS_LOG_DEFAULT MS_LOG_WARN

/* Parse an MPSSHIM_LOG value: "0".."3" or error/warn/info/debug. -1 if malformed. */
int ms_log_parse_level(const char *text);
void ms_log_set_level(int level);
int ms_log_enabled(int level);

void ms_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Like ms_log, but at most one line per second per `rl`: a burst of refusals prints its
 * first line; the next line printed after a second says how many were dropped meanwhile. */
typedef struct ms_ratelimit {
    long long last_ns;
    unsigned long suppressed;
} ms_ratelimit;
void ms_log_limited(ms_ratelimit *rl, int level, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#endif
