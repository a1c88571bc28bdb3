/* Drives csrc/limits.c from tests: one request per stdin line, one answer per stdout line.
 *
 *   limits_cli limits   line = a limit string   -> "OK" then " 0=BYTES" / " GPU-x=BYTES" per entry,
 *                                                  or "ERR <reason>"
 *   limits_cli size     line = a size           -> "OK BYTES" or "ERR"
 *   limits_cli find     line = LIMITS|ORD|UUID  -> "CAP BYTES" or "NOCAP" (or "ERR <reason>") */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "limits.h"

static void answer_limits(const char *line) {
    ms_limits l;
    char err[512];
    if (ms_parse_limits(line, &l, err, sizeof err) != 0) {
        if (strchr(err, '\n') != NULL || err[0] == '\0') {
            printf("BADMSG\n");
            return;
        }
        printf("ERR %s\n", err);
        return;
    }
    printf("OK");
    for (int i = 0; i < l.count; i++) {
        if (l.item[i].ordinal >= 0)
            printf(" %d=%llu", l.item[i].ordinal, (unsigned long long)l.item[i].bytes);
        else
            printf(" %s=%llu", l.item[i].uuid, (unsigned long long)l.item[i].bytes);
    }
    printf("\n");
}

static void answer_size(const char *line, size_t len) {
    uint64_t v = 0;
    if (ms_parse_size(line, len, &v) != 0)
        printf("ERR\n");
    else
        printf("OK %llu\n", (unsigned long long)v);
}

static void answer_find(char *line) {
    char *a = strchr(line, '|');
    char *b = a ? strchr(a + 1, '|') : NULL;
    if (b == NULL) {
        printf("ERR want LIMITS|ORD|UUID\n");
        return;
    }
    *a = *b = '\0';
    ms_limits l;
    char err[512];
    if (ms_parse_limits(line, &l, err, sizeof err) != 0) {
        printf("ERR %s\n", err);
        return;
    }
    uint64_t cap = 0;
    if (ms_limits_find(&l, atoi(a + 1), b[1] ? b + 1 : NULL, &cap))
        printf("CAP %llu\n", (unsigned long long)cap);
    else
        printf("NOCAP\n");
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s limits|size|find < lines\n", argv[0]);
        return 2;
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    while ((n = getline(&line, &cap, stdin)) >= 0) {
        if (n > 0 && line[n - 1] == '\n') line[--n] = '\0';
        if (strcmp(argv[1], "limits") == 0)
            answer_limits(line);
        else if (strcmp(argv[1], "size") == 0)
            answer_size(line, (size_t)n);
        else
            answer_find(line);
        fflush(stdout);
    }
    free(line);
    return 0;
}
