/* jinja_builtins.c - jinja2's tests, the Python methods of str, dict and list that templates
 * call, and the globals (range, namespace, dict, raise_exception, strftime_now). */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "jinja_int.h"

static bool t_number(const jj_value_t *v)
{
    return v->kind == JV_INT || v->kind == JV_FLOAT || v->kind == JV_BOOL;
}

static bool kind_test(const char *name, const jj_value_t *v, bool *r)
{
    static const struct {
        const char *name;
        unsigned kinds; /* bit per jj_kind_t */
    } tests[] = {
        {"defined", ~(1u << JV_UNDEF)},
        {"undefined", 1u << JV_UNDEF},
        {"none", 1u << JV_NONE},
        {"string", 1u << JV_STR},
        {"mapping", 1u << JV_DICT},
        {"iterable", (1u << JV_STR) | (1u << JV_LIST) | (1u << JV_DICT) | (1u << JV_UNDEF)},
        {"sequence", (1u << JV_STR) | (1u << JV_LIST) | (1u << JV_DICT)},
        {"boolean", 1u << JV_BOOL},
        {"integer", 1u << JV_INT},
        {"float", 1u << JV_FLOAT},
        {"callable", 1u << JV_FUNC},
    };
    for (size_t k = 0; k < sizeof tests / sizeof tests[0]; k++)
        if (strcmp(tests[k].name, name) == 0) {
            *r = (tests[k].kinds >> v->kind) & 1u;
            return true;
        }
    if (strcmp(name, "number") == 0) {
        *r = t_number(v);
        return true;
    }
    if (strcmp(name, "true") == 0 || strcmp(name, "false") == 0) {
        *r = v->kind == JV_BOOL && v->u.b == (name[0] == 't');
        return true;
    }
    return false;
}

static bool compare_test(jj_ctx_t *c, const char *name, jj_value_t *v, jj_value_t *o,
                         const jj_node_t *at, bool *r)
{
    if (!strcmp(name, "equalto") || !strcmp(name, "eq") || !strcmp(name, "==") ||
        !strcmp(name, "sameas")) {
        *r = jj_equal(c, at, v, o);
    } else if (!strcmp(name, "ne") || !strcmp(name, "!=")) {
        *r = !jj_equal(c, at, v, o);
    } else if (!strcmp(name, "lt") || !strcmp(name, "lessthan")) {
        *r = jv_compare(c, at, v, o) < 0;
    } else if (!strcmp(name, "gt") || !strcmp(name, "greaterthan")) {
        *r = jv_compare(c, at, v, o) > 0;
    } else if (!strcmp(name, "le")) {
        *r = jv_compare(c, at, v, o) <= 0;
    } else if (!strcmp(name, "ge")) {
        *r = jv_compare(c, at, v, o) >= 0;
    } else if (!strcmp(name, "in")) {
        *r = false;
        if (o->kind == JV_LIST) {
            for (size_t k = 0; k < o->u.list.n && !*r; k++)
                *r = jj_equal(c, at, o->u.list.items[k], v);
        } else if (o->kind == JV_DICT) {
            *r = jv_get(o, v) != NULL;
        } else if (o->kind == JV_STR && v->kind == JV_STR) {
            *r = v->u.str.n == 0 ||
                 (o->u.str.n >= v->u.str.n &&
                  jj_find(o->u.str.s, o->u.str.n, v->u.str.s, v->u.str.n) != NULL);
        }
    } else {
        return false;
    }
    return true;
}

bool jj_test(jj_ctx_t *c, const char *name, jj_value_t *v, jj_args_t *args, const jj_node_t *at)
{
    bool r;
    if (kind_test(name, v, &r))
        return r;
    jj_value_t *o = jj_arg(args, 0, NULL);
    if (o && compare_test(c, name, v, o, at, &r))
        return r;
    if (!strcmp(name, "even") || !strcmp(name, "odd") || !strcmp(name, "divisibleby")) {
        if (v->kind != JV_INT)
            jj_fail(c, at, TDM_EINVALID, "TypeError: test '%s' needs an integer", name);
        int64_t d = !strcmp(name, "divisibleby") ? (o && o->kind == JV_INT ? o->u.i : 0) : 2;
        if (d == 0)
            jj_fail(c, at, TDM_EINVALID, "ZeroDivisionError: integer division or modulo by zero");
        int64_t m = d == -1 ? 0 : v->u.i % d; /* INT64_MIN % -1 traps on x86 */
        return name[0] == 'o' ? m != 0 : m == 0;
    }
    if (!strcmp(name, "lower") || !strcmp(name, "upper")) {
        if (v->kind != JV_STR)
            return false;
        for (size_t i = 0; i < v->u.str.n; i++) {
            int ch = (unsigned char)v->u.str.s[i];
            if (name[0] == 'l' ? isupper(ch) : islower(ch))
                return false;
        }
        return true;
    }
    jj_fail(c, at, TDM_EINVALID, "No test named '%s' found.", name);
}

/* ---- methods ---- */

static jj_value_t *bound(jj_ctx_t *c, jj_value_t *self, jj_builtin_fn fn, const char *name)
{
    jj_value_t *f = jv_new(c, JV_FUNC);
    f->u.func.fn = fn;
    f->u.func.self = self;
    f->u.func.name = name;
    return f;
}

static jj_value_t *need_str(jj_ctx_t *c, jj_value_t *v, const jj_node_t *at)
{
    if (!v || v->kind != JV_STR)
        jj_fail(c, at, TDM_EINVALID, "TypeError: expected a string argument");
    return v;
}

static bool py_space(unsigned char ch)
{
    return ch == ' ' || (ch >= '\t' && ch <= '\r') || (ch >= 0x1c && ch <= 0x1f);
}

static jj_value_t *strip_side(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, bool left, bool right)
{
    return jj_strip(c, s, jj_arg(a, 0, NULL), left, right);
}

static jj_value_t *m_strip(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, const jj_node_t *at)
{
    (void)at;
    return strip_side(c, s, a, true, true);
}

static jj_value_t *m_lstrip(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, const jj_node_t *at)
{
    (void)at;
    return strip_side(c, s, a, true, false);
}

static jj_value_t *m_rstrip(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, const jj_node_t *at)
{
    (void)at;
    return strip_side(c, s, a, false, true);
}

static jj_value_t *split_ws(jj_ctx_t *c, jj_value_t *s, int64_t max)
{
    jj_value_t *l = jv_list(c);
    const char *p = s->u.str.s;
    size_t n = s->u.str.n, i = 0;
    for (;;) {
        while (i < n && py_space((unsigned char)p[i]))
            i++;
        if (i >= n)
            return l;
        if (max >= 0 && (int64_t)l->u.list.n == max) {
            size_t e = n;
            while (e > i && py_space((unsigned char)p[e - 1]))
                e--;
            jv_push(c, l, jv_str(c, p + i, e - i));
            return l;
        }
        size_t j = i;
        while (j < n && !py_space((unsigned char)p[j]))
            j++;
        jv_push(c, l, jv_str(c, p + i, j - i));
        i = j;
    }
}

static jj_value_t *m_split(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, const jj_node_t *at)
{
    jj_value_t *sep = jj_arg(a, 0, "sep"), *mx = jj_arg(a, 1, "maxsplit");
    int64_t max = mx && mx->kind == JV_INT ? mx->u.i : -1;
    if (!sep || sep->kind == JV_NONE)
        return split_ws(c, s, max);
    need_str(c, sep, at);
    if (sep->u.str.n == 0)
        jj_fail(c, at, TDM_EINVALID, "ValueError: empty separator");
    jj_value_t *l = jv_list(c);
    const char *p = s->u.str.s, *end = p + s->u.str.n;
    for (;;) {
        const char *hit =
            max != 0 ? jj_find(p, (size_t)(end - p), sep->u.str.s, sep->u.str.n) : NULL;
        if (!hit) {
            jv_push(c, l, jv_str(c, p, (size_t)(end - p)));
            return l;
        }
        jv_push(c, l, jv_str(c, p, (size_t)(hit - p)));
        p = hit + sep->u.str.n;
        if (max > 0)
            max--;
    }
}

static jj_value_t *m_rsplit(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, const jj_node_t *at)
{
    jj_value_t *sep = jj_arg(a, 0, "sep"), *mx = jj_arg(a, 1, "maxsplit");
    int64_t max = mx && mx->kind == JV_INT ? mx->u.i : -1;
    if (max < 0) /* no bound: the same parts as split */
        return m_split(c, s, a, at);
    if (!sep || sep->kind == JV_NONE)
        jj_fail(c, at, TDM_EINVALID, "rsplit() on whitespace with maxsplit is not supported");
    need_str(c, sep, at);
    jj_value_t *parts = jv_list(c);
    const char *p = s->u.str.s, *end = p + s->u.str.n;
    size_t sn = sep->u.str.n;
    while (max > 0 && sn && (size_t)(end - p) >= sn) {
        const char *hit = NULL;
        for (const char *q = end - sn; q >= p && !hit; q--)
            if (memcmp(q, sep->u.str.s, sn) == 0)
                hit = q;
        if (!hit)
            break;
        jv_push(c, parts, jv_str(c, hit + sn, (size_t)(end - hit - (ptrdiff_t)sn)));
        end = hit;
        max--;
    }
    jv_push(c, parts, jv_str(c, p, (size_t)(end - p)));
    jj_value_t *l = jv_list(c);
    for (size_t k = parts->u.list.n; k-- > 0;)
        jv_push(c, l, parts->u.list.items[k]);
    return l;
}

static bool affix(jj_value_t *s, jj_value_t *x, bool start)
{
    if (x->kind != JV_STR || x->u.str.n > s->u.str.n)
        return false;
    const char *p = start ? s->u.str.s : s->u.str.s + s->u.str.n - x->u.str.n;
    return memcmp(p, x->u.str.s, x->u.str.n) == 0;
}

static jj_value_t *affix_method(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, const jj_node_t *at,
                                bool start)
{
    jj_value_t *x = jj_arg(a, 0, NULL);
    if (!x)
        jj_fail(c, at, TDM_EINVALID, "TypeError: %s() takes at least 1 argument (0 given)",
                start ? "startswith" : "endswith");
    if (x->kind == JV_LIST) {
        for (size_t k = 0; k < x->u.list.n; k++)
            if (affix(s, x->u.list.items[k], start))
                return jv_bool(c, true);
        return jv_bool(c, false);
    }
    need_str(c, x, at);
    return jv_bool(c, affix(s, x, start));
}

static jj_value_t *m_startswith(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, const jj_node_t *at)
{
    return affix_method(c, s, a, at, true);
}

static jj_value_t *m_endswith(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, const jj_node_t *at)
{
    return affix_method(c, s, a, at, false);
}

static jj_value_t *m_upper(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    (void)at;
    return jj_case_map(c, s, 'U');
}

static jj_value_t *m_lower(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    (void)at;
    return jj_case_map(c, s, 'L');
}

static jj_value_t *m_title(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    (void)at;
    return jj_case_map(c, s, 'T');
}

static jj_value_t *m_capitalize(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    (void)at;
    return jj_case_map(c, s, 'C');
}

static jj_value_t *m_replace(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, const jj_node_t *at)
{
    return jj_filter(c, "replace", s, a, at);
}

static jj_value_t *m_find(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, const jj_node_t *at)
{
    jj_value_t *x = need_str(c, jj_arg(a, 0, NULL), at);
    const char *hit =
        x->u.str.n ? jj_find(s->u.str.s, s->u.str.n, x->u.str.s, x->u.str.n) : s->u.str.s;
    if (!hit)
        return jv_int(c, -1);
    int64_t cp = 0;
    for (const char *p = s->u.str.s; p < hit; p++)
        if (((unsigned char)*p & 0xC0) != 0x80)
            cp++;
    return jv_int(c, cp);
}

static jj_value_t *m_count(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, const jj_node_t *at)
{
    jj_value_t *x = jj_arg(a, 0, NULL);
    int64_t n = 0;
    if (s->kind == JV_LIST) {
        for (size_t k = 0; x && k < s->u.list.n; k++)
            n += jj_equal(c, at, s->u.list.items[k], x);
        return jv_int(c, n);
    }
    need_str(c, x, at);
    if (x->u.str.n == 0)
        return jv_int(c, 0);
    const char *p = s->u.str.s, *end = p + s->u.str.n, *hit;
    while ((hit = jj_find(p, (size_t)(end - p), x->u.str.s, x->u.str.n))) {
        n++;
        p = hit + x->u.str.n;
    }
    return jv_int(c, n);
}

static jj_value_t *m_splitlines(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    (void)at;
    jj_value_t *l = jv_list(c);
    const char *p = s->u.str.s, *end = p + s->u.str.n;
    while (p < end) {
        const char *q = p;
        while (q < end && *q != '\n' && *q != '\r')
            q++;
        jv_push(c, l, jv_str(c, p, (size_t)(q - p)));
        if (q < end && *q == '\r' && q + 1 < end && q[1] == '\n')
            q++;
        p = q + (q < end ? 1 : 0);
    }
    return l;
}

static jj_value_t *m_join(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, const jj_node_t *at)
{
    jj_value_t *items = jj_iterable(c, jj_arg(a, 0, NULL) ? a->pos[0] : jv_list(c), at);
    jj_buf_t b = {.c = c};
    jb_put(&b, "", 0);
    for (size_t k = 0; k < items->u.list.n; k++) {
        if (k)
            jb_put(&b, s->u.str.s, s->u.str.n);
        jv_write_str(&b, items->u.list.items[k]);
    }
    return jb_value(&b);
}

/* str.format with {} / {0} / {name} fields (format specs are not supported). */
static jj_value_t *m_format(jj_ctx_t *c, jj_value_t *s, jj_args_t *a, const jj_node_t *at)
{
    jj_buf_t b = {.c = c};
    jb_put(&b, "", 0);
    const char *p = s->u.str.s, *end = p + s->u.str.n;
    size_t auto_index = 0;
    while (p < end) {
        if ((*p == '{' || *p == '}') && p + 1 < end && p[1] == *p) {
            jb_put(&b, p, 1);
            p += 2;
            continue;
        }
        if (*p != '{') {
            jb_put(&b, p++, 1);
            continue;
        }
        const char *close = memchr(p, '}', (size_t)(end - p));
        if (!close)
            jj_fail(c, at, TDM_EINVALID, "ValueError: Single '{' encountered in format string");
        char field[64];
        snprintf(field, sizeof field, "%.*s", (int)(close - p - 1), p + 1);
        if (strchr(field, ':') || strchr(field, '!'))
            jj_fail(c, at, TDM_EINVALID,
                    "str.format: format specs and conversions ('%s') are "
                    "not supported",
                    field);
        jj_value_t *v = NULL;
        if (!field[0])
            v = jj_arg(a, auto_index++, NULL);
        else if (isdigit((unsigned char)field[0]))
            v = jj_arg(a, (size_t)atoi(field), NULL);
        else
            v = jj_arg(a, (size_t)-1, field);
        if (!v)
            jj_fail(c, at, TDM_EINVALID, "IndexError: Replacement index out of range");
        jv_write_str(&b, v);
        p = close + 1;
    }
    return jb_value(&b);
}

static jj_value_t *m_items(jj_ctx_t *c, jj_value_t *d, jj_args_t *a, const jj_node_t *at)
{
    return jj_filter(c, "items", d, a, at);
}

static jj_value_t *m_keys(jj_ctx_t *c, jj_value_t *d, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    return jj_iterable(c, d, at);
}

static jj_value_t *m_values(jj_ctx_t *c, jj_value_t *d, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    (void)at;
    jj_value_t *l = jv_list(c);
    for (size_t k = 0; k < d->u.dict.n; k++)
        jv_push(c, l, d->u.dict.vals[k]);
    return l;
}

static jj_value_t *m_get(jj_ctx_t *c, jj_value_t *d, jj_args_t *a, const jj_node_t *at)
{
    jj_value_t *key = jj_arg(a, 0, NULL), *dflt = jj_arg(a, 1, NULL);
    if (!key)
        jj_fail(c, at, TDM_EINVALID, "TypeError: get expected at least 1 argument, got 0");
    jj_value_t *v = jv_get(d, key);
    return v ? v : dflt ? dflt : jv_none(c);
}

static jj_value_t *m_index(jj_ctx_t *c, jj_value_t *l, jj_args_t *a, const jj_node_t *at)
{
    jj_value_t *x = jj_arg(a, 0, NULL);
    for (size_t k = 0; x && k < l->u.list.n; k++)
        if (jj_equal(c, at, l->u.list.items[k], x))
            return jv_int(c, (int64_t)k);
    jj_fail(c, at, TDM_EINVALID, "ValueError: value is not in list");
}

typedef struct method {
    jj_kind_t kind;
    const char *name;
    jj_builtin_fn fn;
} method_t;

static const method_t METHODS[] = {
    {JV_STR, "strip", m_strip},
    {JV_STR, "lstrip", m_lstrip},
    {JV_STR, "rstrip", m_rstrip},
    {JV_STR, "split", m_split},
    {JV_STR, "rsplit", m_rsplit},
    {JV_STR, "startswith", m_startswith},
    {JV_STR, "endswith", m_endswith},
    {JV_STR, "upper", m_upper},
    {JV_STR, "lower", m_lower},
    {JV_STR, "title", m_title},
    {JV_STR, "capitalize", m_capitalize},
    {JV_STR, "replace", m_replace},
    {JV_STR, "find", m_find},
    {JV_STR, "count", m_count},
    {JV_STR, "splitlines", m_splitlines},
    {JV_STR, "join", m_join},
    {JV_STR, "format", m_format},
    {JV_DICT, "items", m_items},
    {JV_DICT, "keys", m_keys},
    {JV_DICT, "values", m_values},
    {JV_DICT, "get", m_get},
    {JV_LIST, "index", m_index},
    {JV_LIST, "count", m_count},
};

/* Methods that change their object: jinja2's immutable sandbox refuses them. */
static const char *const UNSAFE[] = {"append",  "pop",   "extend",  "insert",
                                     "remove",  "clear", "update",  "setdefault",
                                     "popitem", "sort",  "reverse", NULL};

jj_value_t *jj_method(jj_ctx_t *c, jj_value_t *obj, const char *name, const jj_node_t *at)
{
    (void)at;
    for (size_t k = 0; k < sizeof METHODS / sizeof METHODS[0]; k++)
        if (METHODS[k].kind == obj->kind && strcmp(METHODS[k].name, name) == 0)
            return bound(c, obj, METHODS[k].fn, name);
    if (obj->kind == JV_LIST || obj->kind == JV_DICT) {
        for (size_t k = 0; UNSAFE[k]; k++)
            if (strcmp(UNSAFE[k], name) == 0) {
                jj_buf_t b = {.c = c};
                jb_puts(&b, "access to attribute '");
                jb_puts(&b, name);
                jb_puts(&b, "' of '");
                jb_puts(&b, jv_type_name(obj));
                jb_puts(&b, "' object is unsafe.");
                return jv_undef(c, b.p);
            }
    }
    return NULL;
}

/* ---- globals ---- */

static jj_value_t *g_raise(jj_ctx_t *c, jj_value_t *self, jj_args_t *a, const jj_node_t *at)
{
    (void)self;
    (void)at;
    jj_value_t *m = jj_arg(a, 0, NULL);
    jj_value_t *s = m ? jv_to_str(c, m) : jv_str(c, "", 0);
    c->raised = true;
    /* the template's message as the error's text: NUL bytes written as \x00 (they would end
     * it), an empty one named, so the error always says something */
    char msg[TDM_ERRMSG_MAX];
    size_t k = 0;
    for (size_t i = 0; i < s->u.str.n && k + 5 < sizeof msg; i++) {
        if (s->u.str.s[i] == '\0') {
            memcpy(msg + k, "\\x00", 4);
            k += 4;
        } else {
            msg[k++] = s->u.str.s[i];
        }
    }
    msg[k] = '\0';
    jj_fail(c, NULL, TDM_EINVALID, "%s", k ? msg : "raise_exception() with an empty message");
}

static jj_value_t *g_strftime_now(jj_ctx_t *c, jj_value_t *self, jj_args_t *a, const jj_node_t *at)
{
    (void)self;
    jj_value_t *fmt = need_str(c, jj_arg(a, 0, NULL), at);
    time_t t = (time_t)c->now;
    struct tm tm;
    gmtime_r(&t, &tm);
    char out[256];
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
    size_t n = strftime(out, sizeof out, fmt->u.str.s, &tm); /* the template's own format */
#pragma GCC diagnostic pop
    return jv_str(c, out, n);
}

static jj_value_t *g_range(jj_ctx_t *c, jj_value_t *self, jj_args_t *a, const jj_node_t *at)
{
    (void)self;
    int64_t v[3] = {0, 0, 1};
    for (size_t k = 0; k < a->n_pos && k < 3; k++) {
        if (a->pos[k]->kind != JV_INT)
            jj_fail(c, at, TDM_EINVALID, "TypeError: range() needs integers");
        v[k] = a->pos[k]->u.i;
    }
    int64_t start = a->n_pos > 1 ? v[0] : 0, stop = a->n_pos > 1 ? v[1] : v[0];
    int64_t stepv = a->n_pos > 2 ? v[2] : 1;
    if (stepv == 0)
        jj_fail(c, at, TDM_EINVALID, "ValueError: range() arg 3 must not be zero");
    jj_value_t *l = jv_list(c);
    for (int64_t i = start; stepv > 0 ? i < stop : i > stop;) {
        if (l->u.list.n >= 100000)
            jj_fail(c, at, TDM_ERESOURCE, "range too big");
        jv_push(c, l, jv_int(c, i));
        if (__builtin_add_overflow(i, stepv, &i)) /* the next one is past int64: past stop */
            break;
    }
    return l;
}

static jj_value_t *make_mapping(jj_ctx_t *c, jj_args_t *a, jj_kind_t kind)
{
    jj_value_t *d = jv_new(c, kind);
    if (a->n_pos && a->pos[0]->kind == JV_DICT)
        for (size_t k = 0; k < a->pos[0]->u.dict.n; k++)
            jv_set(c, d, a->pos[0]->u.dict.keys[k], a->pos[0]->u.dict.vals[k]);
    for (size_t k = 0; k < a->n_kw; k++)
        jv_setc(c, d, a->kw_names[k], a->kw[k]);
    return d;
}

static jj_value_t *g_namespace(jj_ctx_t *c, jj_value_t *self, jj_args_t *a, const jj_node_t *at)
{
    (void)self;
    (void)at;
    return make_mapping(c, a, JV_NS);
}

static jj_value_t *g_dict(jj_ctx_t *c, jj_value_t *self, jj_args_t *a, const jj_node_t *at)
{
    (void)self;
    (void)at;
    return make_mapping(c, a, JV_DICT);
}

jj_value_t *jj_loop_cycle(jj_ctx_t *c, jj_value_t *self, jj_args_t *args, const jj_node_t *at)
{
    if (args->n_pos == 0)
        jj_fail(c, at, TDM_EINVALID, "TypeError: no items for cycling given");
    return args->pos[(size_t)self->u.i % args->n_pos];
}

/* One %-conversion of v into b. */
static void percent_one(jj_ctx_t *c, jj_buf_t *b, char conv, jj_value_t *v, const jj_node_t *at)
{
    char num[64];
    if (conv == 's') {
        jv_write_str(b, v);
    } else if (conv == 'r') {
        jv_write_repr(b, v);
    } else if ((conv == 'd' || conv == 'i') &&
               (v->kind == JV_INT || v->kind == JV_BOOL || v->kind == JV_FLOAT)) {
        long long i = v->kind == JV_FLOAT  ? (long long)v->u.f
                      : v->kind == JV_BOOL ? v->u.b
                                           : (long long)v->u.i;
        snprintf(num, sizeof num, "%lld", i);
        jb_puts(b, num);
    } else if (conv == 'f' && (v->kind == JV_INT || v->kind == JV_FLOAT)) {
        snprintf(num, sizeof num, "%f", v->kind == JV_INT ? (double)v->u.i : v->u.f);
        jb_puts(b, num);
    } else {
        jj_fail(c, at, TDM_EINVALID, "TypeError: unsupported format character '%c' for %s", conv,
                jv_type_name(v));
    }
}

jj_value_t *jj_percent_format(jj_ctx_t *c, jj_value_t *fmt, jj_value_t *args, const jj_node_t *at)
{
    bool tuple = args->kind == JV_LIST && args->is_tuple;
    size_t n = tuple ? args->u.list.n : 1, used = 0;
    jj_buf_t b = {.c = c};
    jb_put(&b, "", 0);
    for (size_t i = 0; i < fmt->u.str.n; i++) {
        char ch = fmt->u.str.s[i];
        if (ch != '%' || i + 1 >= fmt->u.str.n) {
            jb_put(&b, &ch, 1);
            continue;
        }
        char conv = fmt->u.str.s[++i];
        if (conv == '%') {
            jb_put(&b, "%", 1);
            continue;
        }
        if (used >= n)
            jj_fail(c, at, TDM_EINVALID, "TypeError: not enough arguments for format string");
        percent_one(c, &b, conv, tuple ? args->u.list.items[used] : args, at);
        used++;
    }
    if (used < n)
        jj_fail(c, at, TDM_EINVALID,
                "TypeError: not all arguments converted during string formatting");
    return jb_value(&b);
}

void jj_add_globals(jj_ctx_t *c, jj_value_t *globals)
{
    static const struct {
        const char *name;
        jj_builtin_fn fn;
    } g[] = {{"raise_exception", g_raise},
             {"strftime_now", g_strftime_now},
             {"range", g_range},
             {"namespace", g_namespace},
             {"dict", g_dict}};
    for (size_t k = 0; k < sizeof g / sizeof g[0]; k++)
        jv_setc(c, globals, g[k].name, bound(c, NULL, g[k].fn, g[k].name));
}
