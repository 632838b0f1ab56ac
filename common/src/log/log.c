/* log.c - logfmt lines on a per-node logger (see tandem/log.h). */
#include "tandem/log.h"

#include <stdarg.h>
#include <stdbool.h>
#include <string.h>
#include <strings.h>
#include <sys/time.h>
#include <time.h>

void tdm_log_init(tdm_logger_t *lg, const char *node)
{
    lg->level = TDM_LOG_INFO;
    lg->out = NULL;
    lg->node[0] = '\0';
    if (node)
        snprintf(lg->node, sizeof lg->node, "%s", node);
}

int tdm_log_level_parse(const char *name)
{
    static const struct {
        const char *name;
        int level;
    } names[] = {
        {"debug", TDM_LOG_DEBUG},  {"info", TDM_LOG_INFO},   {"warn", TDM_LOG_WARN},
        {"warning", TDM_LOG_WARN}, {"error", TDM_LOG_ERROR}, {"off", TDM_LOG_OFF},
    };
    if (!name)
        return -1;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcasecmp(name, names[i].name) == 0)
            return names[i].level;
    return -1;
}

const char *tdm_log_level_name(tdm_log_level_t level)
{
    switch (level) {
    case TDM_LOG_DEBUG: return "debug";
    case TDM_LOG_INFO: return "info";
    case TDM_LOG_WARN: return "warn";
    case TDM_LOG_ERROR: return "error";
    case TDM_LOG_OFF: return "off";
    }
    return "?";
}

static bool needs_quotes(const char *v)
{
    if (!*v)
        return true;
    for (const unsigned char *p = (const unsigned char *)v; *p; p++)
        if (*p <= ' ' || *p == '"' || *p == '=' || *p == '\\' || *p == 0x7f)
            return true;
    return false;
}

int tdm_log_kv_append(char *buf, size_t cap, const char *key, const char *value)
{
    size_t len = strlen(buf), start = len;
    const char *v = value ? value : "";
    bool quote = needs_quotes(v);
    int n = snprintf(buf + len, cap - len, "%s%s=%s", len ? " " : "", key, quote ? "\"" : "");
    if (n < 0 || (size_t)n >= cap - len)
        goto out_overflow;
    len += (size_t)n;
    for (const unsigned char *p = (const unsigned char *)v; *p; p++) {
        char esc[8];
        const char *s = esc;
        if (!quote) {
            esc[0] = (char)*p;
            esc[1] = '\0';
        } else if (*p == '"' || *p == '\\') {
            esc[0] = '\\';
            esc[1] = (char)*p;
            esc[2] = '\0';
        } else if (*p == '\n') {
            s = "\\n";
        } else if (*p == '\t') {
            s = "\\t";
        } else if (*p == '\r') {
            s = "\\r";
        } else if (*p < ' ' || *p == 0x7f) {
            snprintf(esc, sizeof esc, "\\x%02x", *p);
        } else {
            esc[0] = (char)*p;
            esc[1] = '\0';
        }
        size_t sl = strlen(s);
        if (len + sl + 2 > cap)
            goto out_overflow;
        memcpy(buf + len, s, sl);
        len += sl;
    }
    if (quote) {
        if (len + 2 > cap)
            goto out_overflow;
        buf[len++] = '"';
    }
    buf[len] = '\0';
    return (int)len;

out_overflow:
    buf[start] = '\0';
    return -1;
}

void tdm_log_write(const tdm_logger_t *lg, tdm_log_level_t level, const char *req, const char *kv,
                   const char *fmt, ...)
{
    tdm_log_level_t min = lg ? lg->level : TDM_LOG_INFO;
    if (level < min || level >= TDM_LOG_OFF)
        return;
    char line[4096], msg[2048], ts[40];
    struct timeval tv;
    gettimeofday(&tv, NULL);
    struct tm tm;
    gmtime_r(&tv.tv_sec, &tm);
    size_t tl = strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(ts + tl, sizeof ts - tl, ".%03dZ", (int)(tv.tv_usec / 1000));

    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);

    line[0] = '\0';
    tdm_log_kv_append(line, sizeof line, "ts", ts);
    tdm_log_kv_append(line, sizeof line, "level", tdm_log_level_name(level));
    tdm_log_kv_append(line, sizeof line, "node", lg && lg->node[0] ? lg->node : "-");
    if (req)
        tdm_log_kv_append(line, sizeof line, "req", req);
    if (tdm_log_kv_append(line, sizeof line, "msg", msg) < 0)
        tdm_log_kv_append(line, sizeof line, "msg", "(message too long)");
    size_t len = strlen(line);
    if (kv && *kv && len + strlen(kv) + 2 < sizeof line) {
        line[len++] = ' ';
        memcpy(line + len, kv, strlen(kv) + 1);
        len += strlen(kv);
    }
    line[len++] = '\n';
    fwrite(line, 1, len, lg && lg->out ? lg->out : stderr);
}
