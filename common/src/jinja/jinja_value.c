/* jinja_value.c - the renderer's values with Python's semantics: str(), repr(), json.dumps,
 * truthiness, equality and order. */
#define _GNU_SOURCE /* memmem */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_int.h"

struct jj_chunk {
    struct jj_chunk *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
};

void *jj_alloc(jj_arena_t *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    struct jj_chunk *c = a->head;
    if (!c || c->cap - c->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        if (a->max_bytes && a->used_bytes + cap > a->max_bytes)
            return NULL;
        c = malloc(sizeof *c + cap);
        if (!c)
            return NULL;
        c->next = a->head;
        c->used = 0;
        c->cap = cap;
        a->head = c;
        a->used_bytes += cap;
    }
    void *p = c->data + c->used;
    c->used += n;
    a->given_bytes += n;
    memset(p, 0, n);
    return p;
}

void jj_arena_free(jj_arena_t *a)
{
    while (a->head) {
        struct jj_chunk *next = a->head->next;
        free(a->head);
        a->head = next;
    }
    a->used_bytes = 0;
}

static void *calloc_or_fail(jj_ctx_t *c, size_t n)
{
    void *p = jj_alloc(&c->arena, n);
    if (!p)
        jj_fail_memory(c, NULL);
    return p;
}

jj_value_t *jv_new(jj_ctx_t *c, jj_kind_t kind)
{
    jj_value_t *v = calloc_or_fail(c, sizeof *v);
    v->kind = kind;
    return v;
}

jj_value_t *jv_undef(jj_ctx_t *c, const char *hint)
{
    jj_value_t *v = jv_new(c, JV_UNDEF);
    v->u.undef_hint = hint;
    return v;
}

jj_value_t *jv_none(jj_ctx_t *c)
{
    return jv_new(c, JV_NONE);
}

jj_value_t *jv_bool(jj_ctx_t *c, bool b)
{
    jj_value_t *v = jv_new(c, JV_BOOL);
    v->u.b = b;
    return v;
}

jj_value_t *jv_int(jj_ctx_t *c, int64_t i)
{
    jj_value_t *v = jv_new(c, JV_INT);
    v->u.i = i;
    return v;
}

jj_value_t *jv_float(jj_ctx_t *c, double f)
{
    jj_value_t *v = jv_new(c, JV_FLOAT);
    v->u.f = f;
    return v;
}

jj_value_t *jv_str(jj_ctx_t *c, const char *s, size_t n)
{
    jj_value_t *v = jv_new(c, JV_STR);
    char *m = calloc_or_fail(c, n + 1);
    if (n)
        memcpy(m, s, n);
    v->u.str.s = m;
    v->u.str.n = n;
    return v;
}

jj_value_t *jv_cstr(jj_ctx_t *c, const char *s)
{
    return jv_str(c, s, strlen(s));
}

jj_value_t *jv_list(jj_ctx_t *c)
{
    return jv_new(c, JV_LIST);
}

jj_value_t *jv_dict(jj_ctx_t *c)
{
    return jv_new(c, JV_DICT);
}

void jv_push(jj_ctx_t *c, jj_value_t *list, jj_value_t *v)
{
    if (list->u.list.n == list->u.list.cap) {
        size_t cap = list->u.list.cap ? list->u.list.cap * 2 : 4;
        jj_value_t **items = calloc_or_fail(c, cap * sizeof *items);
        if (list->u.list.n)
            memcpy(items, list->u.list.items, list->u.list.n * sizeof *items);
        list->u.list.items = items;
        list->u.list.cap = cap;
    }
    list->u.list.items[list->u.list.n++] = v;
}

static size_t dict_find(const jj_value_t *d, const jj_value_t *key)
{
    for (size_t k = 0; k < d->u.dict.n; k++)
        if (jv_equal(d->u.dict.keys[k], key))
            return k;
    return (size_t)-1;
}

void jv_set(jj_ctx_t *c, jj_value_t *dict, jj_value_t *key, jj_value_t *v)
{
    jj_charge(c, NULL, dict->u.dict.n / 8); /* the keys it scans */
    size_t k = dict_find(dict, key);
    if (k != (size_t)-1) {
        dict->u.dict.vals[k] = v;
        return;
    }
    if (dict->u.dict.n == dict->u.dict.cap) {
        size_t cap = dict->u.dict.cap ? dict->u.dict.cap * 2 : 4;
        jj_value_t **keys = calloc_or_fail(c, cap * sizeof *keys);
        jj_value_t **vals = calloc_or_fail(c, cap * sizeof *vals);
        if (dict->u.dict.n) {
            memcpy(keys, dict->u.dict.keys, dict->u.dict.n * sizeof *keys);
            memcpy(vals, dict->u.dict.vals, dict->u.dict.n * sizeof *vals);
        }
        dict->u.dict.keys = keys;
        dict->u.dict.vals = vals;
        dict->u.dict.cap = cap;
    }
    dict->u.dict.keys[dict->u.dict.n] = key;
    dict->u.dict.vals[dict->u.dict.n++] = v;
}

void jv_setc(jj_ctx_t *c, jj_value_t *dict, const char *key, jj_value_t *v)
{
    jv_set(c, dict, jv_cstr(c, key), v);
}

jj_value_t *jv_get(const jj_value_t *dict, const jj_value_t *key)
{
    size_t k = dict_find(dict, key);
    return k == (size_t)-1 ? NULL : dict->u.dict.vals[k];
}

jj_value_t *jv_getc(const jj_value_t *dict, const char *key)
{
    size_t n = strlen(key);
    for (size_t k = 0; k < dict->u.dict.n; k++) {
        const jj_value_t *kv = dict->u.dict.keys[k];
        if (kv->kind == JV_STR && kv->u.str.n == n && memcmp(kv->u.str.s, key, n) == 0)
            return dict->u.dict.vals[k];
    }
    return NULL;
}

bool jv_is_str(const jj_value_t *v, const char *s)
{
    return v->kind == JV_STR && v->u.str.n == strlen(s) && memcmp(v->u.str.s, s, v->u.str.n) == 0;
}

jj_value_t *jv_from_json(jj_ctx_t *c, const json_t *j)
{
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        jj_value_t *d = jv_dict(c);
        const char *key;
        json_t *val;
        json_object_foreach((json_t *)j, key, val) jv_setc(c, d, key, jv_from_json(c, val));
        return d;
    }
    case JSON_ARRAY: {
        jj_value_t *l = jv_list(c);
        size_t i;
        json_t *val;
        json_array_foreach(j, i, val) jv_push(c, l, jv_from_json(c, val));
        return l;
    }
    case JSON_STRING: return jv_str(c, json_string_value(j), json_string_length(j));
    case JSON_INTEGER: return jv_int(c, json_integer_value(j));
    case JSON_REAL: return jv_float(c, json_real_value(j));
    case JSON_TRUE: return jv_bool(c, true);
    case JSON_FALSE: return jv_bool(c, false);
    default: return jv_none(c);
    }
}

bool jv_truthy(const jj_value_t *v)
{
    switch (v->kind) {
    case JV_UNDEF:
    case JV_NONE: return false;
    case JV_BOOL: return v->u.b;
    case JV_INT: return v->u.i != 0;
    case JV_FLOAT: return v->u.f != 0.0;
    case JV_STR: return v->u.str.n > 0;
    case JV_LIST: return v->is_gen || v->u.list.n > 0;
    case JV_DICT: return v->u.dict.n > 0;
    default: return true;
    }
}

static bool is_number(const jj_value_t *v)
{
    return v->kind == JV_INT || v->kind == JV_FLOAT || v->kind == JV_BOOL;
}

static double num(const jj_value_t *v)
{
    return v->kind == JV_FLOAT ? v->u.f : v->kind == JV_BOOL ? (double)v->u.b : (double)v->u.i;
}

static bool eq(jj_ctx_t *c, const jj_node_t *at, const jj_value_t *a, const jj_value_t *b);

/* eq's body: jv_equal's rule, recursing through eq with the same c. */
static bool eq_body(jj_ctx_t *c, const jj_node_t *at, const jj_value_t *a, const jj_value_t *b)
{
    if (is_number(a) && is_number(b)) {
        if (a->kind != JV_FLOAT && b->kind != JV_FLOAT)
            return (a->kind == JV_BOOL ? a->u.b : a->u.i) == (b->kind == JV_BOOL ? b->u.b : b->u.i);
        return num(a) == num(b);
    }
    if (a->kind != b->kind)
        return false;
    switch (a->kind) {
    case JV_STR: return a->u.str.n == b->u.str.n && memcmp(a->u.str.s, b->u.str.s, a->u.str.n) == 0;
    case JV_LIST:
        if (a->is_tuple != b->is_tuple || a->u.list.n != b->u.list.n)
            return false;
        for (size_t k = 0; k < a->u.list.n; k++)
            if (!eq(c, at, a->u.list.items[k], b->u.list.items[k]))
                return false;
        return true;
    case JV_DICT:
        if (a->u.dict.n != b->u.dict.n)
            return false;
        for (size_t k = 0; k < a->u.dict.n; k++) {
            if (c)
                jj_charge(c, at, b->u.dict.n);
            jj_value_t *o = jv_get(b, a->u.dict.keys[k]);
            if (!o || !eq(c, at, a->u.dict.vals[k], o))
                return false;
        }
        return true;
    case JV_UNDEF:
    case JV_NONE: return true;
    default: return a == b;
    }
}

/* a == b; with c (not NULL) each value compared costs 1 + jj_cost steps and nesting counts as
 * the renderer's frames (a list may be nested 100 000 deep by a loop). */
static bool eq(jj_ctx_t *c, const jj_node_t *at, const jj_value_t *a, const jj_value_t *b)
{
    if (!c)
        return eq_body(NULL, at, a, b);
    uint64_t ca = jj_cost(a), cb = jj_cost(b);
    jj_charge(c, at, 1 + (ca < cb ? ca : cb));
    if (++c->frames > JJ_MAX_FRAMES)
        jj_fail(c, at, TDM_ERESOURCE, "template recursion limit (%d frames) exceeded",
                JJ_MAX_FRAMES);
    bool r = eq_body(c, at, a, b);
    c->frames--;
    return r;
}

bool jv_equal(const jj_value_t *a, const jj_value_t *b)
{
    return eq(NULL, NULL, a, b);
}

bool jj_equal(jj_ctx_t *c, const jj_node_t *at, const jj_value_t *a, const jj_value_t *b)
{
    return eq(c, at, a, b);
}

const char *jj_find(const char *hay, size_t hn, const char *needle, size_t nn)
{
    return nn ? memmem(hay, hn, needle, nn) : NULL;
}

uint64_t jj_cost(const jj_value_t *v)
{
    switch (v->kind) {
    case JV_STR: return v->u.str.n / JJ_BYTES_PER_STEP;
    case JV_LIST: return v->u.list.n;
    case JV_DICT:
    case JV_NS: return v->u.dict.n;
    default: return 0;
    }
}

const char *jv_type_name(const jj_value_t *v)
{
    static const char *const names[] = {"Undefined", "NoneType", "bool", "int",      "float",
                                        "str",       "list",     "dict", "function", "Namespace"};
    if (v->kind == JV_LIST && v->is_tuple)
        return "tuple";
    if (v->kind == JV_LIST && v->is_gen)
        return "generator";
    return names[v->kind];
}

/* <0, 0, >0 as Python orders a and b; TypeError for types Python does not order. */
static int compare_body(jj_ctx_t *c, const jj_node_t *at, const jj_value_t *a, const jj_value_t *b);

int jv_compare(jj_ctx_t *c, const jj_node_t *at, const jj_value_t *a, const jj_value_t *b)
{
    uint64_t ca = jj_cost(a), cb = jj_cost(b);
    jj_charge(c, at, 1 + (ca < cb ? ca : cb));
    if (++c->frames > JJ_MAX_FRAMES)
        jj_fail(c, at, TDM_ERESOURCE, "template recursion limit (%d frames) exceeded",
                JJ_MAX_FRAMES);
    int r = compare_body(c, at, a, b);
    c->frames--;
    return r;
}

static int compare_body(jj_ctx_t *c, const jj_node_t *at, const jj_value_t *a, const jj_value_t *b)
{
    if (is_number(a) && is_number(b)) {
        double x = num(a), y = num(b);
        return x < y ? -1 : x > y ? 1 : 0;
    }
    if (a->kind == JV_STR && b->kind == JV_STR) {
        size_t n = a->u.str.n < b->u.str.n ? a->u.str.n : b->u.str.n;
        int r = memcmp(a->u.str.s, b->u.str.s, n);
        if (r)
            return r;
        return a->u.str.n < b->u.str.n ? -1 : a->u.str.n > b->u.str.n ? 1 : 0;
    }
    if (a->kind == JV_LIST && b->kind == JV_LIST) {
        for (size_t k = 0; k < a->u.list.n && k < b->u.list.n; k++) {
            if (!eq(c, at, a->u.list.items[k], b->u.list.items[k]))
                return jv_compare(c, at, a->u.list.items[k], b->u.list.items[k]);
        }
        return a->u.list.n < b->u.list.n ? -1 : a->u.list.n > b->u.list.n ? 1 : 0;
    }
    jj_fail(c, at, TDM_EINVALID, "TypeError: '<' not supported between instances of '%s' and '%s'",
            jv_type_name(a), jv_type_name(b));
}

void jb_put(jj_buf_t *b, const char *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = calloc_or_fail(b->c, cap);
        if (b->n)
            memcpy(p, b->p, b->n);
        b->p = p;
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void jb_puts(jj_buf_t *b, const char *s)
{
    jb_put(b, s, strlen(s));
}

jj_value_t *jb_value(jj_buf_t *b)
{
    jj_value_t *v = jv_new(b->c, JV_STR);
    v->u.str.s = b->p ? b->p : "";
    v->u.str.n = b->n;
    return v;
}

/* Python's repr(float): the shortest digits that read back the same, positional when the
 * exponent is in [-4, 16), else d.ddde+XX. */
static void write_float(jj_buf_t *b, double f)
{
    char s[64], out[400];
    if (isnan(f) || isinf(f)) {
        jb_puts(b, isnan(f) ? "nan" : f < 0 ? "-inf" : "inf");
        return;
    }
    for (int prec = 0; prec <= 16; prec++) {
        snprintf(s, sizeof s, "%.*e", prec, f);
        if (strtod(s, NULL) == f)
            break;
    }
    char digits[32];
    size_t nd = 0;
    const char *p = s;
    bool neg = *p == '-';
    p += neg;
    for (; *p && *p != 'e'; p++)
        if (*p != '.' && nd + 1 < sizeof digits)
            digits[nd++] = *p;
    digits[nd] = 0;
    int exp = atoi(p + 1);
    size_t k = 0;
    if (neg)
        out[k++] = '-';
    if (exp >= 16 || exp < -4) {
        k += (size_t)snprintf(out + k, sizeof out - k, "%c%s%.*s", digits[0], nd > 1 ? "." : "",
                              (int)(nd - 1), digits + 1);
        snprintf(out + k, sizeof out - k, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    } else if (exp < 0) {
        k += (size_t)snprintf(out + k, sizeof out - k, "0.");
        for (int z = 0; z < -exp - 1; z++)
            out[k++] = '0';
        snprintf(out + k, sizeof out - k, "%s", digits);
    } else {
        for (int i = 0; i <= exp; i++)
            out[k++] = (size_t)i < nd ? digits[i] : '0';
        out[k++] = '.';
        if ((size_t)exp + 1 < nd)
            snprintf(out + k, sizeof out - k, "%s", digits + exp + 1);
        else
            snprintf(out + k, sizeof out - k, "0");
    }
    jb_puts(b, out);
}

static void write_int(jj_buf_t *b, int64_t i)
{
    char s[32];
    snprintf(s, sizeof s, "%lld", (long long)i);
    jb_puts(b, s);
}

static void write_str_repr(jj_buf_t *b, const jj_value_t *v)
{
    const char *s = v->u.str.s;
    size_t n = v->u.str.n;
    char q = memchr(s, '\'', n) && !memchr(s, '"', n) ? '"' : '\'';
    jb_put(b, &q, 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        char e[8];
        if (ch == '\\' || ch == (unsigned char)q) {
            e[0] = '\\';
            e[1] = (char)ch;
            jb_put(b, e, 2);
        } else if (ch == '\n') {
            jb_puts(b, "\\n");
        } else if (ch == '\r') {
            jb_puts(b, "\\r");
        } else if (ch == '\t') {
            jb_puts(b, "\\t");
        } else if (ch < 0x20 || ch == 0x7f) {
            snprintf(e, sizeof e, "\\x%02x", ch);
            jb_puts(b, e);
        } else {
            jb_put(b, (const char *)&ch, 1);
        }
    }
    jb_put(b, &q, 1);
}

/* Enters one more container level of b; fails past 500 (a namespace holding itself). */
static void nest(jj_buf_t *b)
{
    if (++b->depth > 500)
        jj_fail(b->c, NULL, TDM_ERESOURCE, "value nested too deeply to write (over 500 levels)");
}

static void write_container_repr(jj_buf_t *b, const jj_value_t *v)
{
    nest(b);
    if (v->kind == JV_LIST) {
        jb_puts(b, v->is_tuple ? "(" : "[");
        for (size_t k = 0; k < v->u.list.n; k++) {
            if (k)
                jb_puts(b, ", ");
            jv_write_repr(b, v->u.list.items[k]);
        }
        jb_puts(b, v->is_tuple ? (v->u.list.n == 1 ? ",)" : ")") : "]");
        b->depth--;
        return;
    }
    jb_puts(b, "{");
    for (size_t k = 0; k < v->u.dict.n; k++) {
        if (k)
            jb_puts(b, ", ");
        jv_write_repr(b, v->u.dict.keys[k]);
        jb_puts(b, ": ");
        jv_write_repr(b, v->u.dict.vals[k]);
    }
    jb_puts(b, "}");
    b->depth--;
}

void jv_write_repr(jj_buf_t *b, const jj_value_t *v)
{
    switch (v->kind) {
    case JV_STR: write_str_repr(b, v); return;
    case JV_LIST:
    case JV_DICT: write_container_repr(b, v); return;
    case JV_UNDEF: jb_puts(b, "Undefined"); return;
    case JV_NS:
        jb_puts(b, "<Namespace ");
        write_container_repr(b, v);
        jb_puts(b, ">");
        return;
    default: jv_write_str(b, v);
    }
}

void jv_write_str(jj_buf_t *b, const jj_value_t *v)
{
    switch (v->kind) {
    case JV_UNDEF: return;
    case JV_NONE: jb_puts(b, "None"); return;
    case JV_BOOL: jb_puts(b, v->u.b ? "True" : "False"); return;
    case JV_INT: write_int(b, v->u.i); return;
    case JV_FLOAT: write_float(b, v->u.f); return;
    case JV_STR: jb_put(b, v->u.str.s, v->u.str.n); return;
    case JV_FUNC: jb_puts(b, "<function>"); return;
    default: jv_write_repr(b, v);
    }
}

jj_value_t *jv_to_str(jj_ctx_t *c, const jj_value_t *v)
{
    if (v->kind == JV_STR)
        return (jj_value_t *)v;
    jj_buf_t b = {.c = c};
    jv_write_str(&b, v);
    return jb_value(&b);
}

/* One non-ASCII UTF-8 character at s as json's ensure_ascii writes it (\\uXXXX, a surrogate
 * pair above U+FFFF); returns the bytes it took. */
static size_t write_json_escaped(jj_buf_t *b, const char *s, size_t n)
{
    unsigned char c0 = (unsigned char)s[0];
    size_t len = c0 >= 0xF0 ? 4 : c0 >= 0xE0 ? 3 : c0 >= 0xC0 ? 2 : 1;
    if (len > n)
        len = n;
    unsigned long cp = len == 1 ? c0 : c0 & (0x3F >> (len - 1));
    for (size_t k = 1; k < len; k++)
        cp = (cp << 6) | ((unsigned char)s[k] & 0x3F);
    char e[32];
    if (cp >= 0x10000) {
        cp -= 0x10000;
        snprintf(e, sizeof e, "\\u%04lx\\u%04lx", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
    } else {
        snprintf(e, sizeof e, "\\u%04lx", cp);
    }
    jb_puts(b, e);
    return len;
}

static void write_json_string(jj_buf_t *b, const char *s, size_t n)
{
    jb_puts(b, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        char e[8];
        switch (ch) {
        case '"': jb_puts(b, "\\\""); break;
        case '\\': jb_puts(b, "\\\\"); break;
        case '\n': jb_puts(b, "\\n"); break;
        case '\r': jb_puts(b, "\\r"); break;
        case '\t': jb_puts(b, "\\t"); break;
        case '\b': jb_puts(b, "\\b"); break;
        case '\f': jb_puts(b, "\\f"); break;
        default:
            if (ch < 0x20) {
                snprintf(e, sizeof e, "\\u%04x", ch);
                jb_puts(b, e);
            } else if (ch >= 0x80 && b->ascii) {
                i += write_json_escaped(b, s + i, n - i) - 1;
            } else {
                jb_put(b, (const char *)&ch, 1);
            }
        }
    }
    jb_puts(b, "\"");
}

static void json_newline(jj_buf_t *b, int indent, int level)
{
    jb_puts(b, "\n");
    for (int k = 0; k < indent * level; k++)
        jb_puts(b, " ");
}

/* The order to write a dict's n entries in: as inserted, or by key (byte order, as Python
 * orders str keys) with sort_keys. */
static size_t *json_order(jj_buf_t *b, const jj_value_t *v, size_t n)
{
    size_t *ord = jj_alloc(&b->c->arena, (n + 1) * sizeof *ord);
    if (!ord)
        jj_fail_memory(b->c, NULL);
    for (size_t k = 0; k < n; k++) {
        size_t j = k;
        while (b->sort_keys && v->kind == JV_DICT && j > 0 &&
               v->u.dict.keys[ord[j - 1]]->kind == JV_STR && v->u.dict.keys[k]->kind == JV_STR &&
               jv_compare(b->c, NULL, v->u.dict.keys[ord[j - 1]], v->u.dict.keys[k]) > 0) {
            ord[j] = ord[j - 1];
            j--;
        }
        ord[j] = k;
    }
    return ord;
}

static void write_json_key(jj_buf_t *b, const jj_value_t *key)
{
    if (key->kind == JV_STR) {
        write_json_string(b, key->u.str.s, key->u.str.n);
    } else {
        jj_buf_t t = {.c = b->c};
        jv_write_str(&t, key);
        write_json_string(b, t.p ? t.p : "", t.n);
    }
    jb_puts(b, b->key_sep ? b->key_sep : ": ");
}

static int write_json_container(jj_buf_t *b, const jj_value_t *v, int indent, int level)
{
    if (level > 500)
        jj_fail(b->c, NULL, TDM_ERESOURCE, "value nested too deeply to write (over 500 levels)");
    bool list = v->kind == JV_LIST;
    size_t n = list ? v->u.list.n : v->u.dict.n;
    jb_puts(b, list ? "[" : "{");
    if (n == 0) {
        jb_puts(b, list ? "]" : "}");
        return 0;
    }
    size_t *ord = json_order(b, v, n);
    for (size_t k = 0; k < n; k++) {
        if (k)
            jb_puts(b, b->item_sep ? b->item_sep : indent >= 0 ? "," : ", ");
        if (indent >= 0)
            json_newline(b, indent, level + 1);
        if (!list)
            write_json_key(b, v->u.dict.keys[ord[k]]);
        int rc =
            jv_write_json(b, list ? v->u.list.items[k] : v->u.dict.vals[ord[k]], indent, level + 1);
        if (rc)
            return rc;
    }
    if (indent >= 0)
        json_newline(b, indent, level);
    jb_puts(b, list ? "]" : "}");
    return 0;
}

/* json.dumps(v, ensure_ascii=False) with indent (< 0: None); -1 when v holds something JSON
 * cannot serialize (b then holds a partial text). */
int jv_write_json(jj_buf_t *b, const jj_value_t *v, int indent, int level)
{
    switch (v->kind) {
    case JV_NONE: jb_puts(b, "null"); return 0;
    case JV_BOOL: jb_puts(b, v->u.b ? "true" : "false"); return 0;
    case JV_INT: write_int(b, v->u.i); return 0;
    case JV_FLOAT:
        if (isnan(v->u.f) || isinf(v->u.f)) {
            jb_puts(b, isnan(v->u.f) ? "NaN" : v->u.f < 0 ? "-Infinity" : "Infinity");
            return 0;
        }
        write_float(b, v->u.f);
        return 0;
    case JV_STR: write_json_string(b, v->u.str.s, v->u.str.n); return 0;
    case JV_LIST:
    case JV_DICT: return v->is_gen ? -1 : write_json_container(b, v, indent, level);
    default: return -1;
    }
}
