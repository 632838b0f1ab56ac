/* jinja_filters.c - jinja2's filters and tests that chat templates use, with jinja2 3.1's
 * behaviour (and transformers' tojson). */
#include <ctype.h>
#include <locale.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <wctype.h>

#include "jinja_int.h"

typedef jj_value_t *(*filter_fn)(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at);

static jj_value_t *str_of(jj_ctx_t *c, jj_value_t *v)
{
    return jv_to_str(c, v);
}

static bool arg_true(jj_args_t *a, size_t pos, const char *kw)
{
    jj_value_t *v = jj_arg(a, pos, kw);
    return v && jv_truthy(v);
}

/* The first value inside v that JSON cannot hold (v itself when none inside is). */
static const jj_value_t *unserializable(const jj_value_t *v)
{
    if (v->kind == JV_LIST && !v->is_gen)
        for (size_t k = 0; k < v->u.list.n; k++)
            if (v->u.list.items[k]->kind > JV_DICT || v->u.list.items[k]->kind == JV_UNDEF ||
                v->u.list.items[k]->is_gen)
                return unserializable(v->u.list.items[k]);
    if (v->kind == JV_DICT)
        for (size_t k = 0; k < v->u.dict.n; k++)
            if (v->u.dict.vals[k]->kind > JV_DICT || v->u.dict.vals[k]->kind == JV_UNDEF ||
                v->u.dict.vals[k]->is_gen)
                return unserializable(v->u.dict.vals[k]);
    return v;
}

/* separators=(item, key): two strings, else the defaults (NULL). */
static void json_separators(jj_buf_t *b, jj_value_t *seps)
{
    if (!seps || seps->kind != JV_LIST || seps->u.list.n != 2)
        return;
    jj_value_t *item = seps->u.list.items[0], *key = seps->u.list.items[1];
    if (item->kind == JV_STR && key->kind == JV_STR) {
        b->item_sep = item->u.str.s;
        b->key_sep = key->u.str.s;
    }
}

/* transformers' tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
 * json.dumps with those arguments. */
static jj_value_t *f_tojson(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    jj_value_t *ind = jj_arg(a, 1, "indent");
    jj_buf_t b = {
        .c = c, .ascii = arg_true(a, 0, "ensure_ascii"), .sort_keys = arg_true(a, 3, "sort_keys")};
    json_separators(&b, jj_arg(a, 2, "separators"));
    jb_put(&b, "", 0);
    int indent = ind && ind->kind == JV_INT ? (int)ind->u.i : -1;
    if (jv_write_json(&b, v, indent, 0) != 0) {
        const jj_value_t *bad = unserializable(v);
        jj_fail(c, at, TDM_EINVALID, "TypeError: Object of type %s is not JSON serializable",
                jv_type_name(bad));
    }
    return jb_value(&b);
}

static size_t utf8_len(const jj_value_t *s)
{
    size_t k = 0;
    for (size_t i = 0; i < s->u.str.n; i++)
        if (((unsigned char)s->u.str.s[i] & 0xC0) != 0x80)
            k++;
    return k;
}

static jj_value_t *f_length(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    switch (v->kind) {
    case JV_STR: return jv_int(c, (int64_t)utf8_len(v));
    case JV_LIST:
        if (v->is_gen)
            break;
        return jv_int(c, (int64_t)v->u.list.n);
    case JV_DICT: return jv_int(c, (int64_t)v->u.dict.n);
    case JV_UNDEF: return jv_int(c, 0);
    default: break;
    }
    jj_fail(c, at, TDM_EINVALID, "TypeError: object of type '%s' has no len()", jv_type_name(v));
}

static jj_value_t *f_default(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)at;
    jj_value_t *d = jj_arg(a, 0, "default_value");
    bool boolean = arg_true(a, 1, "boolean");
    if (v->kind == JV_UNDEF || (boolean && !jv_truthy(v)))
        return d ? d : jv_str(c, "", 0);
    return v;
}

/* Python's str.isspace() for one code point: what str.strip() removes by default. */
static bool py_space(uint32_t cp)
{
    return cp == ' ' || (cp >= '\t' && cp <= '\r') || (cp >= 0x1c && cp <= 0x1f) || cp == 0x85 ||
           cp == 0xa0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 ||
           cp == 0x2029 || cp == 0x202f || cp == 0x205f || cp == 0x3000;
}

/* The code point of the character at p[i] (n bytes in all); a byte that begins no well-formed
 * character stands for itself, length 1. */
static uint32_t cp_at(const char *p, size_t i, size_t n, size_t *len)
{
    uint32_t cp;
    *len = tdm_utf8_decode((const unsigned char *)p + i, n - i, &cp);
    if (*len == 0) {
        *len = 1;
        cp = (unsigned char)p[i];
    }
    return cp;
}

/* Whether cp is stripped: whitespace, or one of the code points of chars. */
static bool strip_this(uint32_t cp, const jj_value_t *chars)
{
    if (!chars)
        return py_space(cp);
    for (size_t i = 0, len; i < chars->u.str.n; i += len)
        if (cp_at(chars->u.str.s, i, chars->u.str.n, &len) == cp)
            return true;
    return false;
}

/* Python's str.strip / lstrip / rstrip, by code point (jinja2's trim is str.strip). */
jj_value_t *jj_strip(jj_ctx_t *c, jj_value_t *s, jj_value_t *chars, bool left, bool right)
{
    const char *p = s->u.str.s;
    size_t lo = 0, hi = s->u.str.n, len;
    if (chars && chars->kind != JV_STR)
        chars = NULL;
    while (left && lo < hi && strip_this(cp_at(p, lo, hi, &len), chars))
        lo += len;
    while (right && hi > lo) {
        size_t start = hi - 1;
        while (start > lo && hi - start < 4 && ((unsigned char)p[start] & 0xc0) == 0x80)
            start--;
        uint32_t cp = cp_at(p, start, hi, &len);
        if (start + len != hi) { /* not one whole character: its last byte stands alone */
            start = hi - 1;
            cp = (unsigned char)p[start];
        }
        if (!strip_this(cp, chars))
            break;
        hi = start;
    }
    return jv_str(c, p + lo, hi - lo);
}

static jj_value_t *f_trim(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)at;
    return jj_strip(c, str_of(c, v), jj_arg(a, 0, "chars"), true, true);
}

static jj_value_t *f_string(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    (void)at;
    return str_of(c, v);
}

static jj_value_t *f_safe(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    (void)at;
    jj_value_t *s = str_of(c, v);
    jj_value_t *r = jv_str(c, s->u.str.s, s->u.str.n);
    r->is_safe = true;
    return r;
}

static jj_value_t *f_escape(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    (void)at;
    if (v->kind == JV_STR && v->is_safe)
        return v;
    jj_buf_t b = {.c = c};
    jb_put(&b, "", 0);
    jj_put_escaped(&b, jv_to_str(c, v));
    jj_value_t *r = jb_value(&b);
    r->is_safe = true;
    return r;
}

/* One UTF-8 code point at s (n > 0 bytes left) into *cp; returns its length (1 for a byte
 * that starts no valid sequence, taken as itself). */
static size_t utf8_get(const unsigned char *s, size_t n, uint32_t *cp)
{
    size_t len = s[0] >= 0xF0 ? 4 : s[0] >= 0xE0 ? 3 : s[0] >= 0xC0 ? 2 : 1;
    if (len > n)
        len = 1;
    uint32_t v = len == 1 ? s[0] : s[0] & (0x3Fu >> (len - 1));
    for (size_t k = 1; k < len; k++) {
        if ((s[k] & 0xC0) != 0x80) {
            *cp = s[0];
            return 1;
        }
        v = (v << 6) | (s[k] & 0x3Fu);
    }
    *cp = v;
    return len;
}

static void utf8_put_cp(jj_buf_t *b, uint32_t cp)
{
    char o[4];
    size_t n;
    if (cp < 0x80) {
        o[0] = (char)cp;
        n = 1;
    } else if (cp < 0x800) {
        o[0] = (char)(0xC0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3F));
        n = 2;
    } else if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        n = 3;
    } else {
        o[0] = (char)(0xF0 | (cp >> 18));
        o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[3] = (char)(0x80 | (cp & 0x3F));
        n = 4;
    }
    jb_put(b, o, n);
}

/* True when cp ends a word for jinja2's title filter (whitespace - ( { [ <). */
static bool jinja_title_break(uint32_t cp)
{
    return cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' || cp == ' ' ||
           (cp >= '\t' && cp <= '\r');
}

/* Upper, lower, capitalize, Python's str.title ('T') or jinja2's title filter ('J') of v,
 * code point by code point with the C.UTF-8 locale's simple case mappings (ASCII only where
 * that locale is missing; Python's few one-to-many mappings such as ß -> SS are not made). */
jj_value_t *jj_case_map(jj_ctx_t *c, jj_value_t *v, int mode)
{
    jj_value_t *s = str_of(c, v);
    locale_t loc = newlocale(LC_CTYPE_MASK, "C.UTF-8", (locale_t)0);
    jj_buf_t b = {.c = c};
    jb_put(&b, "", 0);
    bool word_start = true, first = true;
    const unsigned char *p = (const unsigned char *)s->u.str.s;
    for (size_t i = 0; i < s->u.str.n;) {
        uint32_t cp;
        i += utf8_get(p + i, s->u.str.n - i, &cp);
        bool ascii = cp < 0x80, up;
        if (mode == 'U' || mode == 'L')
            up = mode == 'U';
        else if (mode == 'C')
            up = first;
        else
            up = word_start;
        uint32_t out = cp;
        if (ascii || loc)
            out = (uint32_t)(up ? (loc ? towupper_l((wint_t)cp, loc) : toupper((int)cp))
                                : (loc ? towlower_l((wint_t)cp, loc) : tolower((int)cp)));
        utf8_put_cp(&b, out);
        bool alpha = ascii ? isalpha((int)cp) != 0 : loc && iswalpha_l((wint_t)cp, loc);
        word_start = mode == 'J' ? jinja_title_break(cp) : !alpha;
        first = false;
    }
    if (loc)
        freelocale(loc);
    return jb_value(&b);
}

static jj_value_t *f_upper(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    (void)at;
    return jj_case_map(c, v, 'U');
}

static jj_value_t *f_lower(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    (void)at;
    return jj_case_map(c, v, 'L');
}

static jj_value_t *f_capitalize(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    (void)at;
    return jj_case_map(c, v, 'C');
}

static jj_value_t *f_title(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    (void)at;
    return jj_case_map(c, v, 'J');
}

/* item's attribute attr as jinja2's attribute= takes it: a dotted path whose all-digit parts
 * are indexes ("function.name", "0.a"); item itself when attr is NULL. */
static jj_value_t *attr_of(jj_ctx_t *c, jj_value_t *item, jj_value_t *attr, const jj_node_t *at)
{
    if (!attr)
        return item;
    if (attr->kind == JV_INT)
        return jj_getitem(c, item, attr, at);
    jj_value_t *s = str_of(c, attr);
    const char *p = s->u.str.s, *end = p + s->u.str.n;
    for (;;) {
        const char *dot = memchr(p, '.', (size_t)(end - p));
        size_t n = dot ? (size_t)(dot - p) : (size_t)(end - p);
        bool digits = n > 0;
        for (size_t i = 0; i < n; i++)
            digits = digits && p[i] >= '0' && p[i] <= '9';
        jj_value_t *key = digits ? jv_int(c, strtoll(p, NULL, 10)) : jv_str(c, p, n);
        item = jj_getitem(c, item, key, at);
        if (!dot)
            return item;
        p = dot + 1;
    }
}

static jj_value_t *f_join(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    jj_value_t *sep = jj_arg(a, 0, "d");
    jj_value_t *attr = jj_arg(a, 1, "attribute");
    jj_value_t *items = jj_iterable(c, v, at);
    jj_buf_t b = {.c = c};
    jb_put(&b, "", 0);
    for (size_t k = 0; k < items->u.list.n; k++) {
        if (k && sep)
            jv_write_str(&b, sep);
        jv_write_str(&b, attr_of(c, items->u.list.items[k], attr, at));
    }
    return jb_value(&b);
}

static jj_value_t *replace(jj_ctx_t *c, jj_value_t *s, jj_value_t *old, jj_value_t *new,
                           int64_t count)
{
    jj_buf_t b = {.c = c};
    jb_put(&b, "", 0);
    const char *p = s->u.str.s;
    size_t n = s->u.str.n, on = old->u.str.n, i = 0;
    int64_t done = 0;
    while (i <= n) {
        if ((count < 0 || done < count) && i + on <= n && memcmp(p + i, old->u.str.s, on) == 0) {
            jb_put(&b, new->u.str.s, new->u.str.n);
            done++;
            if (on == 0) {
                if (i < n)
                    jb_put(&b, p + i, 1);
                i++;
            } else {
                i += on;
            }
        } else {
            if (i < n)
                jb_put(&b, p + i, 1);
            i++;
        }
    }
    return jb_value(&b);
}

static jj_value_t *f_replace(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    jj_value_t *old = jj_arg(a, 0, "old"), *new = jj_arg(a, 1, "new"), *cnt = jj_arg(a, 2, "count");
    if (!old || !new)
        jj_fail(c, at, TDM_EINVALID, "replace() needs two arguments");
    return replace(c, str_of(c, v), str_of(c, old), str_of(c, new),
                   cnt && cnt->kind == JV_INT ? cnt->u.i : -1);
}

static jj_value_t *pair(jj_ctx_t *c, jj_value_t *k, jj_value_t *v)
{
    jj_value_t *t = jv_list(c);
    t->is_tuple = true;
    jv_push(c, t, k);
    jv_push(c, t, v);
    return t;
}

static jj_value_t *f_items(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    jj_value_t *l = jv_list(c);
    if (v->kind == JV_UNDEF)
        return l;
    if (v->kind != JV_DICT)
        jj_fail(c, at, TDM_EINVALID, "TypeError: Can only get item pairs from a mapping.");
    for (size_t k = 0; k < v->u.dict.n; k++)
        jv_push(c, l, pair(c, v->u.dict.keys[k], v->u.dict.vals[k]));
    return l;
}

/* Stable insertion sort by key (values are few); by_key picks pair[0]. */
static void sort_values(jj_ctx_t *c, const jj_node_t *at, jj_value_t **items, jj_value_t **keys,
                        size_t n, bool reverse)
{
    for (size_t i = 1; i < n; i++) {
        jj_value_t *it = items[i], *key = keys[i];
        size_t j = i;
        while (j > 0) {
            int r = jv_compare(c, at, keys[j - 1], key);
            if (reverse ? r >= 0 : r <= 0)
                break;
            items[j] = items[j - 1];
            keys[j] = keys[j - 1];
            j--;
        }
        items[j] = it;
        keys[j] = key;
    }
}

static jj_value_t *fold_key(jj_ctx_t *c, jj_value_t *k, bool case_sensitive)
{
    return !case_sensitive && k->kind == JV_STR ? jj_case_map(c, k, 'L') : k;
}

static jj_value_t *sorted(jj_ctx_t *c, jj_value_t *items, jj_value_t *attr, bool reverse,
                          bool case_sensitive, int pair_index, const jj_node_t *at)
{
    size_t n = items->u.list.n;
    jj_value_t *r = jv_list(c);
    jj_value_t **keys = jj_alloc(&c->arena, (n + 1) * sizeof *keys);
    if (!keys)
        jj_fail_memory(c, at);
    for (size_t k = 0; k < n; k++) {
        jj_value_t *it = items->u.list.items[k];
        jv_push(c, r, it);
        jj_value_t *key = pair_index >= 0 ? it->u.list.items[pair_index] : attr_of(c, it, attr, at);
        keys[k] = fold_key(c, key, case_sensitive);
    }
    sort_values(c, at, r->u.list.items, keys, n, reverse);
    return r;
}

static jj_value_t *f_dictsort(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    jj_value_t *by = jj_arg(a, 1, "by");
    int idx = by && jv_is_str(by, "value") ? 1 : 0;
    return sorted(c, f_items(c, v, a, at), NULL, arg_true(a, 2, "reverse"),
                  arg_true(a, 0, "case_sensitive"), idx, at);
}

static jj_value_t *f_sort(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    return sorted(c, jj_iterable(c, v, at), jj_arg(a, 2, "attribute"), arg_true(a, 0, "reverse"),
                  arg_true(a, 1, "case_sensitive"), -1, at);
}

static jj_value_t *f_list(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    jj_value_t *items = jj_iterable(c, v, at), *l = jv_list(c);
    for (size_t k = 0; k < items->u.list.n; k++)
        jv_push(c, l, items->u.list.items[k]);
    return l;
}

static jj_value_t *f_first(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    if (v->kind == JV_LIST && v->is_gen) { /* next(): takes one item from the generator */
        if (!v->u.list.n)
            return jv_undef(c, "No first item, sequence was empty.");
        v->u.list.n--;
        v->u.list.cap--;
        return *v->u.list.items++;
    }
    jj_value_t *items = jj_iterable(c, v, at);
    return items->u.list.n ? items->u.list.items[0]
                           : jv_undef(c, "No first item, sequence was empty.");
}

static jj_value_t *f_last(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    if (v->kind == JV_LIST && v->is_gen) /* jinja2 takes next(reversed(seq)) */
        jj_fail(c, at, TDM_EINVALID, "TypeError: 'generator' object is not reversible");
    jj_value_t *items = jj_iterable(c, v, at);
    return items->u.list.n ? items->u.list.items[items->u.list.n - 1]
                           : jv_undef(c, "No last item, sequence was empty.");
}

static jj_value_t *f_reverse(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    if (v->kind == JV_STR) {
        jj_value_t *chars = jj_iterable(c, v, at);
        jj_buf_t b = {.c = c};
        jb_put(&b, "", 0);
        for (size_t k = chars->u.list.n; k-- > 0;)
            jv_write_str(&b, chars->u.list.items[k]);
        return jb_value(&b);
    }
    jj_value_t *items = jj_iterable(c, v, at), *l = jv_list(c);
    for (size_t k = items->u.list.n; k-- > 0;)
        jv_push(c, l, items->u.list.items[k]);
    return l;
}

static jj_value_t *f_int(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)at;
    jj_value_t *d = jj_arg(a, 0, "default");
    switch (v->kind) {
    case JV_INT: return v;
    case JV_BOOL: return jv_int(c, v->u.b);
    case JV_FLOAT: return jv_int(c, (int64_t)v->u.f);
    case JV_STR: {
        char *end;
        long long i = strtoll(v->u.str.s, &end, 10);
        if (end != v->u.str.s && *end == 0)
            return jv_int(c, i);
        double f = strtod(v->u.str.s, &end);
        if (end != v->u.str.s && *end == 0)
            return jv_int(c, (int64_t)f);
        break;
    }
    default: break;
    }
    return d ? d : jv_int(c, 0);
}

static jj_value_t *f_float(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)at;
    jj_value_t *d = jj_arg(a, 0, "default");
    if (v->kind == JV_FLOAT)
        return v;
    if (v->kind == JV_INT || v->kind == JV_BOOL)
        return jv_float(c, v->kind == JV_INT ? (double)v->u.i : v->u.b);
    if (v->kind == JV_STR) {
        char *end;
        double f = strtod(v->u.str.s, &end);
        if (end != v->u.str.s && *end == 0)
            return jv_float(c, f);
    }
    return d ? d : jv_float(c, 0.0);
}

static jj_value_t *f_abs(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    if (v->kind == JV_INT) {
        if (v->u.i == INT64_MIN)
            jj_fail(c, at, TDM_EINVALID, "OverflowError: integer result out of 64-bit range");
        return jv_int(c, v->u.i < 0 ? -v->u.i : v->u.i);
    }
    if (v->kind == JV_FLOAT)
        return jv_float(c, fabs(v->u.f));
    jj_fail(c, at, TDM_EINVALID, "TypeError: bad operand type for abs(): '%s'", jv_type_name(v));
}

static jj_value_t *f_round(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    jj_value_t *p = jj_arg(a, 0, "precision");
    double scale = pow(10.0, p && p->kind == JV_INT ? (double)p->u.i : 0.0);
    if (v->kind != JV_INT && v->kind != JV_FLOAT)
        jj_fail(c, at, TDM_EINVALID, "TypeError: round() needs a number");
    double x = v->kind == JV_INT ? (double)v->u.i : v->u.f;
    return jv_float(c, nearbyint(x * scale) / scale);
}

static jj_value_t *f_indent(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    jj_value_t *w = jj_arg(a, 0, "width");
    if (w && w->kind == JV_INT && (uint64_t)w->u.i > c->limits.max_output_bytes && w->u.i > 0)
        jj_fail(c, at, TDM_ERESOURCE,
                "indent width %lld is past the template output limit (%zu bytes)",
                (long long)w->u.i, c->limits.max_output_bytes);
    bool first = arg_true(a, 1, "first"), blank = arg_true(a, 2, "blank");
    jj_buf_t pad = {.c = c};
    jb_put(&pad, "", 0);
    if (w && w->kind == JV_STR)
        jv_write_str(&pad, w);
    else
        for (int64_t k = 0; k < (w && w->kind == JV_INT ? w->u.i : 4); k++)
            jb_puts(&pad, " ");
    jj_value_t *s = str_of(c, v);
    jj_buf_t b = {.c = c};
    jb_put(&b, "", 0);
    const char *p = s->u.str.s, *end = p + s->u.str.n;
    bool at_line_start = true, is_first = true;
    while (p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t len = nl ? (size_t)(nl - p) : (size_t)(end - p);
        if (at_line_start && (is_first ? first : (blank || len > 0)))
            jb_put(&b, pad.p, pad.n);
        jb_put(&b, p, len);
        if (nl)
            jb_puts(&b, "\n");
        p += len + (nl ? 1 : 0);
        is_first = false;
    }
    return jb_value(&b);
}

static bool call_test(jj_ctx_t *c, jj_value_t *item, jj_args_t *a, size_t from, const jj_node_t *at)
{
    jj_value_t *name = jj_arg(a, from, NULL);
    if (!name)
        return jv_truthy(item);
    jj_args_t rest = {.pos = a->pos + from + 1, .n_pos = a->n_pos - from - 1};
    return jj_test(c, str_of(c, name)->u.str.s, item, &rest, at);
}

static jj_value_t *select_items(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at,
                                bool by_attr, bool want)
{
    jj_value_t *l = jv_list(c);
    l->is_gen = true;
    if (!jv_truthy(v)) /* jinja2: "if value:" before iterating */
        return l;
    jj_value_t *items = jj_iterable(c, v, at);
    for (size_t k = 0; k < items->u.list.n; k++) {
        jj_value_t *it = items->u.list.items[k];
        jj_value_t *x = by_attr ? attr_of(c, it, jj_arg(a, 0, NULL), at) : it;
        if (call_test(c, x, a, by_attr ? 1 : 0, at) == want)
            jv_push(c, l, it);
    }
    return l;
}

static jj_value_t *f_selectattr(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    return select_items(c, v, a, at, true, true);
}

static jj_value_t *f_rejectattr(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    return select_items(c, v, a, at, true, false);
}

static jj_value_t *f_select(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    return select_items(c, v, a, at, false, true);
}

static jj_value_t *f_reject(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    return select_items(c, v, a, at, false, false);
}

static jj_value_t *f_map(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    jj_value_t *items = jj_iterable(c, v, at), *l = jv_list(c);
    jj_value_t *attr = jj_arg(a, 99, "attribute"), *dflt = jj_arg(a, 99, "default");
    jj_value_t *name = attr ? NULL : jj_arg(a, 0, NULL);
    l->is_gen = true;
    jj_args_t rest = {.pos = a->pos + (a->n_pos ? 1 : 0), .n_pos = a->n_pos ? a->n_pos - 1 : 0};
    for (size_t k = 0; k < items->u.list.n; k++) {
        jj_value_t *it = items->u.list.items[k];
        if (attr) {
            jj_value_t *x = attr_of(c, it, attr, at);
            jv_push(c, l, x->kind == JV_UNDEF && dflt ? dflt : x);
        } else if (name) {
            jv_push(c, l, jj_filter(c, str_of(c, name)->u.str.s, it, &rest, at));
        } else {
            jv_push(c, l, it);
        }
    }
    return l;
}

static jj_value_t *f_unique(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    jj_value_t *items = jj_iterable(c, v, at), *l = jv_list(c);
    jj_value_t *attr = jj_arg(a, 1, "attribute");
    for (size_t k = 0; k < items->u.list.n; k++) {
        jj_value_t *x = fold_key(c, attr_of(c, items->u.list.items[k], attr, at),
                                 arg_true(a, 0, "case_sensitive"));
        bool seen = false;
        for (size_t j = 0; j < k && !seen; j++)
            seen = jj_equal(c, at,
                            fold_key(c, attr_of(c, items->u.list.items[j], attr, at),
                                     arg_true(a, 0, "case_sensitive")),
                            x);
        if (!seen)
            jv_push(c, l, items->u.list.items[k]);
    }
    return l;
}

static jj_value_t *min_max(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at, int sign)
{
    jj_value_t *items = jj_iterable(c, v, at);
    if (!items->u.list.n)
        return jv_undef(c, "No aggregated item, sequence was empty.");
    jj_value_t *attr = jj_arg(a, 1, "attribute"), *best = items->u.list.items[0];
    for (size_t k = 1; k < items->u.list.n; k++) {
        jj_value_t *it = items->u.list.items[k];
        if (jv_compare(c, at, attr_of(c, it, attr, at), attr_of(c, best, attr, at)) * sign > 0)
            best = it;
    }
    return best;
}

static jj_value_t *f_min(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    return min_max(c, v, a, at, -1);
}

static jj_value_t *f_max(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    return min_max(c, v, a, at, 1);
}

static jj_value_t *f_wordcount(jj_ctx_t *c, jj_value_t *v, jj_args_t *a, const jj_node_t *at)
{
    (void)a;
    (void)at;
    jj_value_t *s = str_of(c, v);
    int64_t n = 0;
    bool in_word = false;
    for (size_t i = 0; i < s->u.str.n; i++) {
        bool w = isalnum((unsigned char)s->u.str.s[i]) || s->u.str.s[i] == '_' ||
                 (unsigned char)s->u.str.s[i] >= 0x80;
        if (w && !in_word)
            n++;
        in_word = w;
    }
    return jv_int(c, n);
}

static const struct {
    const char *name;
    filter_fn fn;
} FILTERS[] = {
    {"tojson", f_tojson},
    {"length", f_length},
    {"count", f_length},
    {"default", f_default},
    {"d", f_default},
    {"trim", f_trim},
    {"string", f_string},
    {"safe", f_safe},
    {"e", f_escape},
    {"escape", f_escape},
    {"upper", f_upper},
    {"lower", f_lower},
    {"capitalize", f_capitalize},
    {"title", f_title},
    {"join", f_join},
    {"replace", f_replace},
    {"items", f_items},
    {"dictsort", f_dictsort},
    {"sort", f_sort},
    {"list", f_list},
    {"first", f_first},
    {"last", f_last},
    {"reverse", f_reverse},
    {"int", f_int},
    {"float", f_float},
    {"abs", f_abs},
    {"round", f_round},
    {"indent", f_indent},
    {"selectattr", f_selectattr},
    {"rejectattr", f_rejectattr},
    {"select", f_select},
    {"reject", f_reject},
    {"map", f_map},
    {"unique", f_unique},
    {"min", f_min},
    {"max", f_max},
    {"wordcount", f_wordcount},
};

jj_value_t *jj_filter(jj_ctx_t *c, const char *name, jj_value_t *v, jj_args_t *args,
                      const jj_node_t *at)
{
    for (size_t k = 0; k < sizeof FILTERS / sizeof FILTERS[0]; k++)
        if (strcmp(FILTERS[k].name, name) == 0)
            return FILTERS[k].fn(c, v, args, at);
    jj_fail(c, at, TDM_EINVALID, "No filter named '%s' found.", name);
}
