/* jinja_eval.c - evaluates the syntax tree: expressions to values, statements to output,
 * with jinja2's scoping (a for loop's body and a macro get their own scope). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_int.h"

enum { LOOP_NONE, LOOP_BREAK, LOOP_CONTINUE };

_Noreturn void jj_fail(jj_ctx_t *c, const jj_node_t *at, int code, const char *fmt, ...)
{
    char msg[TDM_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (at)
        tdm_error_set(c->err, code, "%d:%d: %s", at->line, at->col, msg);
    else
        tdm_error_set(c->err, code, "%s", msg);
    c->code = code;
    longjmp(c->fail, 1);
}

_Noreturn void jj_fail_memory(jj_ctx_t *c, const jj_node_t *at)
{
    if (c->arena.used_bytes + 65536 + 4096 > c->arena.max_bytes) /* a chunk did not fit */
        jj_fail(c, at ? at : c->at, TDM_ERESOURCE, "template memory limit (%zu bytes) exceeded",
                c->arena.max_bytes);
    jj_fail(c, at ? at : c->at, TDM_ERESOURCE, "out of memory");
}

void jj_charge(jj_ctx_t *c, const jj_node_t *at, uint64_t steps)
{
    c->steps += steps;
    if (!at)
        return; /* no place to name: the next charge with one checks */
    size_t built = c->arena.given_bytes - c->arena_base;
    if (c->steps + built / JJ_ALLOC_BYTES_PER_STEP > c->limits.max_steps)
        jj_fail(c, at, TDM_ERESOURCE, "template step limit (%llu) exceeded",
                (unsigned long long)c->limits.max_steps);
}

static void step(jj_ctx_t *c, const jj_node_t *n)
{
    jj_charge(c, n, 1);
}

/* A lookup in a dict scans its keys: one step per 8. */
static void charge_lookup(jj_ctx_t *c, const jj_node_t *at, const jj_value_t *dict)
{
    jj_charge(c, at, dict->u.dict.n / 8);
}

/* An operation's arguments: what it may scan. */
static void charge_args(jj_ctx_t *c, const jj_node_t *at, const jj_args_t *a)
{
    uint64_t cost = 0;
    for (size_t k = 0; k < a->n_pos; k++)
        cost += jj_cost(a->pos[k]);
    for (size_t k = 0; k < a->n_kw; k++)
        cost += jj_cost(a->kw[k]);
    jj_charge(c, at, cost);
}

/* Enters one recursive frame of the renderer (jj_eval, jj_exec, a filter chain): fails when
 * the frames now open pass JJ_MAX_FRAMES, or, as a net under that count (builtins add frames
 * of their own), when the stack used since the rendering began passes JJ_MAX_STACK_BYTES. */
static void enter_frame(jj_ctx_t *c, const jj_node_t *n)
{
    char here;
    uintptr_t at = (uintptr_t)&here;
    uintptr_t used = at < c->stack_base ? c->stack_base - at : at - c->stack_base;
    if (++c->frames > JJ_MAX_FRAMES || used > JJ_MAX_STACK_BYTES)
        jj_fail(c, n, TDM_ERESOURCE, "template recursion limit (%d frames) exceeded",
                JJ_MAX_FRAMES);
}

/* Output lives in the arena (so a failure inside a captured block leaks nothing); it grows by
 * doubling, so the copies left behind add up to less than the output itself. */
static void emit(jj_ctx_t *c, const jj_node_t *at, const char *s, size_t n)
{
    jj_charge(c, at, n / JJ_BYTES_PER_STEP);
    if (c->out_len + n > c->limits.max_output_bytes)
        jj_fail(c, at, TDM_ERESOURCE, "template output limit (%zu bytes) exceeded",
                c->limits.max_output_bytes);
    if (c->out_len + n + 1 > c->out_cap) {
        size_t cap = c->out_cap ? c->out_cap : 4096;
        while (cap < c->out_len + n + 1)
            cap *= 2;
        char *p = jj_alloc(&c->arena, cap);
        if (!p)
            jj_fail_memory(c, at);
        if (c->out_len)
            memcpy(p, c->out, c->out_len);
        c->out = p;
        c->out_cap = cap;
    }
    memcpy(c->out + c->out_len, s, n);
    c->out_len += n;
    c->out[c->out_len] = 0;
}

static void undefined_fail(jj_ctx_t *c, const jj_value_t *v, const jj_node_t *at)
{
    jj_fail(c, at, TDM_EINVALID, "%s", v->u.undef_hint ? v->u.undef_hint : "undefined value");
}

jj_value_t *jj_lookup(jj_ctx_t *c, const char *name)
{
    for (jj_scope_t *s = c->scope; s; s = s->parent) {
        charge_lookup(c, NULL, s->vars);
        jj_value_t *v = jv_getc(s->vars, name);
        if (v)
            return v;
    }
    jj_value_t *g = jv_getc(c->globals, name);
    if (g)
        return g;
    jj_buf_t b = {.c = c};
    jb_puts(&b, "'");
    jb_puts(&b, name);
    jb_puts(&b, "' is undefined");
    return jv_undef(c, b.p);
}

static const char *no_attr(jj_ctx_t *c, const jj_value_t *obj, const char *name)
{
    jj_buf_t b = {.c = c};
    if (obj->kind == JV_NONE) {
        jb_puts(&b, "'None' has no attribute '");
    } else {
        jb_puts(&b, "'");
        jb_puts(&b, jv_type_name(obj));
        jb_puts(&b, " object' has no attribute '");
    }
    jb_puts(&b, name);
    jb_puts(&b, "'");
    return b.p;
}

jj_value_t *jj_getattr(jj_ctx_t *c, jj_value_t *obj, const char *name, const jj_node_t *at)
{
    if (obj->kind == JV_UNDEF)
        undefined_fail(c, obj, at);
    if (obj->kind == JV_NS || obj->kind == JV_DICT) {
        jj_value_t *m = obj->kind == JV_DICT ? jj_method(c, obj, name, at) : NULL;
        if (m)
            return m;
        charge_lookup(c, at, obj);
        jj_value_t *v = jv_getc(obj, name);
        if (v)
            return v;
        return jv_undef(c, no_attr(c, obj, name));
    }
    jj_value_t *m = jj_method(c, obj, name, at);
    return m ? m : jv_undef(c, no_attr(c, obj, name));
}

/* Python's slice indices of [start:stop:step] over n items: the count, first and stride. */
static size_t slice_range(jj_ctx_t *c, const jj_node_t *n, size_t len, int64_t *first,
                          int64_t *stride)
{
    int64_t st = 1, lo, hi, ln = (int64_t)len;
    if (n->orelse) {
        jj_value_t *s = jj_eval(c, n->orelse);
        if (s->kind == JV_INT)
            st = s->u.i;
    }
    if (st == 0)
        jj_fail(c, n, TDM_EINVALID, "ValueError: slice step cannot be zero");
    jj_value_t *a = n->b ? jj_eval(c, n->b) : NULL, *b = n->c ? jj_eval(c, n->c) : NULL;
    bool has_a = a && a->kind == JV_INT, has_b = b && b->kind == JV_INT;
    if (st > 0) {
        lo = has_a ? a->u.i : 0;
        hi = has_b ? b->u.i : ln;
        lo = lo < 0 ? (lo + ln < 0 ? 0 : lo + ln) : (lo > ln ? ln : lo);
        hi = hi < 0 ? (hi + ln < 0 ? 0 : hi + ln) : (hi > ln ? ln : hi);
        *first = lo;
        *stride = st;
        return hi > lo ? (size_t)((hi - lo - 1) / st + 1) : 0; /* no overflow at a huge step */
    }
    lo = has_a ? a->u.i : ln - 1;
    hi = has_b ? b->u.i : -ln - 1;
    lo = lo < 0 ? (lo + ln < 0 ? -1 : lo + ln) : (lo >= ln ? ln - 1 : lo);
    hi = hi < 0 ? (hi + ln < 0 ? -1 : hi + ln) : (hi >= ln ? ln - 1 : hi);
    *first = lo;
    *stride = st;
    return lo > hi ? (size_t)((lo - hi - 1) / st * -1 + 1) : 0;
}

/* Byte offsets of the code points of a UTF-8 string (n + 1 entries); returns the count. */
static size_t utf8_offsets(jj_ctx_t *c, const jj_value_t *s, size_t **offs)
{
    size_t *o = jj_alloc(&c->arena, (s->u.str.n + 1) * sizeof *o);
    if (!o)
        jj_fail_memory(c, NULL);
    size_t k = 0;
    for (size_t i = 0; i < s->u.str.n; i++)
        if (((unsigned char)s->u.str.s[i] & 0xC0) != 0x80)
            o[k++] = i;
    o[k] = s->u.str.n;
    *offs = o;
    return k;
}

static jj_value_t *eval_slice(jj_ctx_t *c, const jj_node_t *n)
{
    jj_value_t *obj = jj_eval(c, n->a);
    jj_charge(c, n, jj_cost(obj));
    int64_t first, stride;
    if (obj->kind == JV_LIST) {
        size_t cnt = slice_range(c, n, obj->u.list.n, &first, &stride);
        jj_value_t *r = jv_list(c);
        r->is_tuple = obj->is_tuple;
        for (size_t k = 0; k < cnt; k++)
            jv_push(c, r, obj->u.list.items[first + (int64_t)k * stride]);
        return r;
    }
    if (obj->kind == JV_STR) {
        size_t *offs;
        size_t len = utf8_offsets(c, obj, &offs);
        size_t cnt = slice_range(c, n, len, &first, &stride);
        jj_buf_t b = {.c = c};
        jb_put(&b, "", 0);
        for (size_t k = 0; k < cnt; k++) {
            size_t i = (size_t)(first + (int64_t)k * stride);
            jb_put(&b, obj->u.str.s + offs[i], offs[i + 1] - offs[i]);
        }
        return jb_value(&b);
    }
    if (obj->kind == JV_UNDEF)
        undefined_fail(c, obj, n);
    jj_fail(c, n, TDM_EINVALID, "TypeError: '%s' object is not subscriptable", jv_type_name(obj));
}

/* jinja2's Undefined hint for obj[key] with a key that is not a string. */
static const char *no_element(jj_ctx_t *c, const jj_value_t *obj, const jj_value_t *key)
{
    jj_buf_t b = {.c = c};
    if (obj->kind == JV_NONE) {
        jb_puts(&b, "None");
    } else {
        jb_puts(&b, jv_type_name(obj));
        jb_puts(&b, " object");
    }
    jb_puts(&b, " has no element ");
    jv_write_repr(&b, key);
    return b.p;
}

jj_value_t *jj_getitem(jj_ctx_t *c, jj_value_t *obj, jj_value_t *key, const jj_node_t *at)
{
    if (obj->kind == JV_UNDEF)
        undefined_fail(c, obj, at);
    if (obj->kind == JV_DICT || obj->kind == JV_NS) {
        charge_lookup(c, at, obj);
        jj_value_t *v = jv_get(obj, key);
        if (v)
            return v;
        if (key->kind == JV_STR)
            return jj_getattr(c, obj, key->u.str.s, at);
        return jv_undef(c, no_element(c, obj, key));
    }
    if ((obj->kind == JV_LIST || obj->kind == JV_STR) && (key->kind == JV_INT)) {
        size_t *offs = NULL;
        if (obj->kind == JV_STR)
            jj_charge(c, at, jj_cost(obj));
        size_t len = obj->kind == JV_LIST ? obj->u.list.n : utf8_offsets(c, obj, &offs);
        int64_t i = key->u.i < 0 ? key->u.i + (int64_t)len : key->u.i;
        if (i < 0 || i >= (int64_t)len)
            return jv_undef(c, no_element(c, obj, key));
        if (obj->kind == JV_LIST)
            return obj->u.list.items[i];
        return jv_str(c, obj->u.str.s + offs[i], offs[i + 1] - offs[i]);
    }
    if (key->kind == JV_STR)
        return jj_getattr(c, obj, key->u.str.s, at);
    return jv_undef(c, no_element(c, obj, key));
}

jj_value_t *jj_iterable(jj_ctx_t *c, jj_value_t *v, const jj_node_t *at)
{
    switch (v->kind) {
    case JV_LIST: {
        if (!v->is_gen)
            return v;
        jj_value_t *items = jv_list(c); /* a generator is used up by one pass, as in Python */
        items->u.list.items = v->u.list.items;
        items->u.list.n = items->u.list.cap = v->u.list.n;
        v->u.list.n = 0;
        return items;
    }
    case JV_UNDEF: return jv_list(c);
    case JV_DICT: {
        jj_value_t *l = jv_list(c);
        for (size_t k = 0; k < v->u.dict.n; k++)
            jv_push(c, l, v->u.dict.keys[k]);
        return l;
    }
    case JV_STR: {
        size_t *offs;
        size_t n = utf8_offsets(c, v, &offs);
        jj_value_t *l = jv_list(c);
        for (size_t k = 0; k < n; k++)
            jv_push(c, l, jv_str(c, v->u.str.s + offs[k], offs[k + 1] - offs[k]));
        return l;
    }
    default:
        jj_fail(c, at, TDM_EINVALID, "TypeError: '%s' object is not iterable", jv_type_name(v));
    }
}

static jj_value_t *eval_args(jj_ctx_t *c, const jj_node_t *n, jj_args_t *a)
{
    memset(a, 0, sizeof *a);
    a->pos = jj_alloc(&c->arena, (n->n_kids + 1) * sizeof *a->pos);
    a->kw = jj_alloc(&c->arena, (n->n_kids + 1) * sizeof *a->kw);
    a->kw_names = jj_alloc(&c->arena, (n->n_kids + 1) * sizeof *a->kw_names);
    if (!a->pos || !a->kw || !a->kw_names)
        jj_fail_memory(c, n);
    for (size_t k = 0; k < n->n_kids; k++) {
        const jj_node_t *arg = n->kids[k];
        if (arg->kind == JN_KWARG) {
            a->kw_names[a->n_kw] = arg->name;
            a->kw[a->n_kw++] = jj_eval(c, arg->a);
        } else {
            a->pos[a->n_pos++] = jj_eval(c, arg);
        }
    }
    return NULL;
}

jj_value_t *jj_arg(jj_args_t *a, size_t pos, const char *kw)
{
    if (pos < a->n_pos)
        return a->pos[pos];
    for (size_t k = 0; kw && k < a->n_kw; k++)
        if (strcmp(a->kw_names[k], kw) == 0)
            return a->kw[k];
    return NULL;
}

static bool is_num(const jj_value_t *v)
{
    return v->kind == JV_INT || v->kind == JV_FLOAT || v->kind == JV_BOOL;
}

static double fnum(const jj_value_t *v)
{
    return v->kind == JV_FLOAT ? v->u.f : v->kind == JV_BOOL ? (double)v->u.b : (double)v->u.i;
}

static int64_t inum(const jj_value_t *v)
{
    return v->kind == JV_BOOL ? (int64_t)v->u.b : v->u.i;
}

/* s as markupsafe's escape() writes it (& < > ' " as entities). */
void jj_put_escaped(jj_buf_t *b, const jj_value_t *s)
{
    for (size_t i = 0; i < s->u.str.n; i++) {
        char ch = s->u.str.s[i];
        const char *e = ch == '&'    ? "&amp;"
                        : ch == '<'  ? "&lt;"
                        : ch == '>'  ? "&gt;"
                        : ch == '\'' ? "&#39;"
                        : ch == '"'  ? "&#34;"
                                     : NULL;
        if (e)
            jb_puts(b, e);
        else
            jb_put(b, &ch, 1);
    }
}

/* a + b of two strings or two lists; a safe string (Markup) escapes a plain one it meets. */
static jj_value_t *concat_seq(jj_ctx_t *c, jj_value_t *a, jj_value_t *b)
{
    if (a->kind == JV_STR) {
        bool safe = a->is_safe || b->is_safe;
        jj_buf_t buf = {.c = c};
        jb_put(&buf, "", 0);
        if (safe && !a->is_safe)
            jj_put_escaped(&buf, a);
        else
            jb_put(&buf, a->u.str.s, a->u.str.n);
        if (safe && !b->is_safe)
            jj_put_escaped(&buf, b);
        else
            jb_put(&buf, b->u.str.s, b->u.str.n);
        jj_value_t *r = jb_value(&buf);
        r->is_safe = safe;
        return r;
    }
    jj_value_t *l = jv_list(c);
    l->is_tuple = a->is_tuple;
    for (size_t k = 0; k < a->u.list.n; k++)
        jv_push(c, l, a->u.list.items[k]);
    for (size_t k = 0; k < b->u.list.n; k++)
        jv_push(c, l, b->u.list.items[k]);
    return l;
}

static const char *op_name(int op)
{
    switch (op) {
    case 'F': return "//";
    case 'P': return "**";
    case '+': return "+";
    case '-': return "-";
    case '*': return "*";
    case '/': return "/";
    default: return "%";
    }
}

/* Python's integers are unbounded, Tandem's are 64-bit: a result that does not fit fails. */
_Noreturn static void int_overflow(jj_ctx_t *c, const jj_node_t *n)
{
    jj_fail(c, n, TDM_EINVALID, "OverflowError: integer result out of 64-bit range");
}

static int64_t int_pow(jj_ctx_t *c, const jj_node_t *n, int64_t x, int64_t y)
{
    if (x == 0 || x == 1)
        return y == 0 ? 1 : x;
    if (x == -1)
        return y % 2 ? -1 : 1;
    int64_t r = 1;
    for (int64_t k = 0; k < y; k++)
        if (__builtin_mul_overflow(r, x, &r))
            int_overflow(c, n);
    return r;
}

static jj_value_t *int_divmod(jj_ctx_t *c, const jj_node_t *n, int op, int64_t x, int64_t y)
{
    if (y == 0)
        jj_fail(c, n, TDM_EINVALID, "ZeroDivisionError: integer division or modulo by zero");
    if (x == INT64_MIN && y == -1)
        return op == 'F' ? (int_overflow(c, n), NULL) : jv_int(c, 0);
    int64_t q = x / y, r = x % y;
    if (r != 0 && ((r < 0) != (y < 0))) { /* Python floors */
        q--;
        r += y;
    }
    return jv_int(c, op == 'F' ? q : r);
}

static jj_value_t *int_op(jj_ctx_t *c, const jj_node_t *n, int op, int64_t x, int64_t y)
{
    int64_t r = 0;
    switch (op) {
    case '+':
        if (__builtin_add_overflow(x, y, &r))
            int_overflow(c, n);
        return jv_int(c, r);
    case '-':
        if (__builtin_sub_overflow(x, y, &r))
            int_overflow(c, n);
        return jv_int(c, r);
    case '*':
        if (__builtin_mul_overflow(x, y, &r))
            int_overflow(c, n);
        return jv_int(c, r);
    case '/':
        if (y == 0)
            jj_fail(c, n, TDM_EINVALID, "ZeroDivisionError: division by zero");
        return jv_float(c, (double)x / (double)y);
    case 'P':
        if (y < 0)
            return jv_float(c, pow((double)x, (double)y));
        return jv_int(c, int_pow(c, n, x, y));
    default: return int_divmod(c, n, op, x, y);
    }
}

static jj_value_t *float_op(jj_ctx_t *c, const jj_node_t *n, int op, double x, double y)
{
    if ((op == '/' || op == 'F' || op == '%') && y == 0)
        jj_fail(c, n, TDM_EINVALID, "ZeroDivisionError: float division by zero");
    switch (op) {
    case '+': return jv_float(c, x + y);
    case '-': return jv_float(c, x - y);
    case '*': return jv_float(c, x * y);
    case '/': return jv_float(c, x / y);
    case 'F': return jv_float(c, floor(x / y));
    case 'P': return jv_float(c, pow(x, y));
    default: {
        double r = fmod(x, y);
        if (r != 0 && ((r < 0) != (y < 0)))
            r += y;
        return jv_float(c, r);
    }
    }
}

/* seq * times, refused when the result would pass the output limit. */
static jj_value_t *repeat(jj_ctx_t *c, const jj_node_t *n, jj_value_t *seq, int64_t times)
{
    size_t len = seq->kind == JV_STR ? seq->u.str.n : seq->u.list.n, total;
    if (times <= 0 || len == 0) /* Python: an empty sequence, however many times */
        return seq->kind == JV_STR ? jv_str(c, "", 0) : jv_list(c);
    if (__builtin_mul_overflow(len, (size_t)times, &total) || total > c->limits.max_output_bytes)
        jj_fail(c, n, TDM_ERESOURCE, "template output limit (%zu bytes) exceeded",
                c->limits.max_output_bytes);
    if (seq->kind == JV_STR) {
        jj_buf_t b = {.c = c};
        jb_put(&b, "", 0);
        for (int64_t k = 0; k < times; k++)
            jb_put(&b, seq->u.str.s, seq->u.str.n);
        return jb_value(&b);
    }
    jj_value_t *r = jv_list(c);
    for (int64_t k = 0; k < times; k++)
        for (size_t i = 0; i < len; i++)
            jv_push(c, r, seq->u.list.items[i]);
    return r;
}

static jj_value_t *binop(jj_ctx_t *c, const jj_node_t *n, jj_value_t *a, jj_value_t *b)
{
    int op = n->op;
    if (op == '~') {
        jj_buf_t buf = {.c = c};
        jb_put(&buf, "", 0);
        jv_write_str(&buf, a);
        jv_write_str(&buf, b);
        return jb_value(&buf);
    }
    if (a->kind == JV_UNDEF)
        undefined_fail(c, a, n);
    if (b->kind == JV_UNDEF)
        undefined_fail(c, b, n);
    if (is_num(a) && is_num(b)) {
        if (a->kind != JV_FLOAT && b->kind != JV_FLOAT)
            return int_op(c, n, op, inum(a), inum(b));
        return float_op(c, n, op, fnum(a), fnum(b));
    }
    if (op == '+' && a->kind == b->kind && (a->kind == JV_STR || a->kind == JV_LIST))
        return concat_seq(c, a, b);
    if (op == '*' && (a->kind == JV_STR || a->kind == JV_LIST) && b->kind == JV_INT)
        return repeat(c, n, a, b->u.i);
    if (op == '*' && (b->kind == JV_STR || b->kind == JV_LIST) && a->kind == JV_INT)
        return repeat(c, n, b, a->u.i);
    if (op == '%' && a->kind == JV_STR)
        return jj_percent_format(c, a, b, n);
    if (op == '+' && a->kind == JV_STR)
        jj_fail(c, n, TDM_EINVALID, "TypeError: can only concatenate str (not \"%s\") to str",
                jv_type_name(b));
    jj_fail(c, n, TDM_EINVALID, "TypeError: unsupported operand type(s) for %s: '%s' and '%s'",
            op_name(op), jv_type_name(a), jv_type_name(b));
}

static bool contains(jj_ctx_t *c, const jj_node_t *n, jj_value_t *item, jj_value_t *seq)
{
    switch (seq->kind) {
    case JV_STR:
        if (item->kind != JV_STR)
            jj_fail(c, n, TDM_EINVALID,
                    "TypeError: 'in <string>' requires string as left "
                    "operand, not %s",
                    jv_type_name(item));
        jj_charge(c, n, jj_cost(seq) + jj_cost(item));
        return item->u.str.n == 0 ||
               jj_find(seq->u.str.s, seq->u.str.n, item->u.str.s, item->u.str.n) != NULL;
    case JV_LIST:
        for (size_t k = 0; k < seq->u.list.n; k++)
            if (jj_equal(c, n, seq->u.list.items[k], item))
                return true;
        return false;
    case JV_DICT:
    case JV_NS: charge_lookup(c, n, seq); return jv_get(seq, item) != NULL;
    case JV_UNDEF: return false;
    default:
        jj_fail(c, n, TDM_EINVALID, "TypeError: argument of type '%s' is not iterable",
                jv_type_name(seq));
    }
}

static jj_value_t *compare(jj_ctx_t *c, const jj_node_t *n)
{
    jj_value_t *a = jj_eval(c, n->a), *b = jj_eval(c, n->b);
    bool r;
    switch (n->op) {
    case 'E': r = jj_equal(c, n, a, b); break;
    case 'N': r = !jj_equal(c, n, a, b); break;
    case 'I': r = contains(c, n, a, b) != n->negate; break;
    case '<': r = jv_compare(c, n, a, b) < 0; break;
    case '>': r = jv_compare(c, n, a, b) > 0; break;
    case 'L': r = jv_compare(c, n, a, b) <= 0; break;
    default: r = jv_compare(c, n, a, b) >= 0; break;
    }
    return jv_bool(c, r);
}

/* Runs body into a fresh output and returns what it wrote as a string. */
static jj_value_t *capture(jj_ctx_t *c, const jj_node_t *body)
{
    char *out = c->out;
    size_t len = c->out_len, cap = c->out_cap;
    c->out = NULL;
    c->out_len = c->out_cap = 0;
    jj_exec(c, body);
    jj_value_t *v = jv_new(c, JV_STR);
    v->u.str.s = c->out ? c->out : "";
    v->u.str.n = c->out_len;
    c->out = out;
    c->out_len = len;
    c->out_cap = cap;
    return v;
}

static jj_value_t *call_macro(jj_ctx_t *c, jj_value_t *f, jj_args_t *args, const jj_node_t *at)
{
    const jj_node_t *m = f->u.func.macro;
    if (++c->depth > c->limits.max_depth)
        jj_fail(c, at, TDM_ERESOURCE, "template recursion depth limit (%u) exceeded",
                c->limits.max_depth);
    jj_scope_t *scope = jj_alloc(&c->arena, sizeof *scope);
    if (!scope)
        jj_fail_memory(c, at);
    scope->parent = f->u.func.closure;
    scope->vars = jv_dict(c);
    jj_scope_t *saved = c->scope;
    c->scope = scope;
    for (size_t k = 0; k < m->n_kids; k++) {
        const jj_node_t *p = m->kids[k];
        jj_value_t *v = jj_arg(args, k, p->name);
        if (!v)
            v = p->a ? jj_eval(c, p->a) : jv_undef(c, "parameter was not provided");
        jv_setc(c, scope->vars, p->name, v);
    }
    jj_value_t *caller = jj_arg(args, (size_t)-1, "caller");
    if (caller)
        jv_setc(c, scope->vars, "caller", caller);
    jj_value_t *r = capture(c, m->body);
    c->scope = saved;
    c->depth--;
    return r;
}

jj_value_t *jj_call_value(jj_ctx_t *c, jj_value_t *f, jj_args_t *args, const jj_node_t *at)
{
    if (f->kind == JV_UNDEF)
        undefined_fail(c, f, at);
    if (f->kind != JV_FUNC)
        jj_fail(c, at, TDM_EINVALID, "TypeError: '%s' object is not callable", jv_type_name(f));
    if (f->u.func.macro)
        return call_macro(c, f, args, at);
    return f->u.func.fn(c, f->u.func.self, args, at);
}

static jj_value_t *eval_seq(jj_ctx_t *c, const jj_node_t *n)
{
    if (n->kind == JN_DICT) {
        jj_value_t *d = jv_dict(c);
        for (size_t k = 0; k < n->n_kids; k++)
            jv_set(c, d, jj_eval(c, n->kids[k]->a), jj_eval(c, n->kids[k]->b));
        return d;
    }
    jj_value_t *l = jv_list(c);
    l->is_tuple = n->kind == JN_TUPLE;
    for (size_t k = 0; k < n->n_kids; k++)
        jv_push(c, l, jj_eval(c, n->kids[k]));
    return l;
}

static jj_value_t *eval_call(jj_ctx_t *c, const jj_node_t *n)
{
    jj_value_t *f = jj_eval(c, n->a);
    jj_args_t args;
    eval_args(c, n, &args);
    charge_args(c, n, &args);
    if (f->kind == JV_FUNC && f->u.func.self) /* a method scans its object */
        jj_charge(c, n, jj_cost(f->u.func.self));
    jj_value_t *r = jj_call_value(c, f, &args, n);
    jj_charge(c, n, jj_cost(r));
    return r;
}

static jj_value_t *eval_filter(jj_ctx_t *c, const jj_node_t *n, jj_value_t *v)
{
    jj_args_t args;
    eval_args(c, n, &args);
    charge_args(c, n, &args);
    jj_charge(c, n, jj_cost(v));
    jj_value_t *r = jj_filter(c, n->name, v, &args, n);
    jj_charge(c, n, jj_cost(r));
    return r;
}

static jj_value_t *eval_logic(jj_ctx_t *c, const jj_node_t *n)
{
    switch (n->kind) {
    case JN_AND: {
        jj_value_t *a = jj_eval(c, n->a);
        return jv_truthy(a) ? jj_eval(c, n->b) : a;
    }
    case JN_OR: {
        jj_value_t *a = jj_eval(c, n->a);
        return jv_truthy(a) ? a : jj_eval(c, n->b);
    }
    case JN_NOT: return jv_bool(c, !jv_truthy(jj_eval(c, n->a)));
    default: /* JN_COND */
        if (jv_truthy(jj_eval(c, n->b)))
            return jj_eval(c, n->a);
        return n->c ? jj_eval(c, n->c) : jv_undef(c, "the inline if-expression evaluated to false");
    }
}

static jj_value_t *eval_unary(jj_ctx_t *c, const jj_node_t *n)
{
    jj_value_t *v = jj_eval(c, n->a);
    if (v->kind == JV_UNDEF)
        undefined_fail(c, v, n);
    if (!is_num(v))
        jj_fail(c, n, TDM_EINVALID, "TypeError: bad operand type for unary %s: '%s'",
                n->kind == JN_NEG ? "-" : "+", jv_type_name(v));
    if (n->kind == JN_POS)
        return v->kind == JV_BOOL ? jv_int(c, v->u.b) : v;
    if (v->kind == JV_FLOAT)
        return jv_float(c, -v->u.f);
    if (inum(v) == INT64_MIN)
        int_overflow(c, n);
    return jv_int(c, -inum(v));
}

static jj_value_t *eval_node(jj_ctx_t *c, const jj_node_t *n)
{
    switch (n->kind) {
    case JN_CONST: return n->value;
    case JN_NAME: return jj_lookup(c, n->name);
    case JN_LIST:
    case JN_TUPLE:
    case JN_DICT: return eval_seq(c, n);
    case JN_ATTR: return jj_getattr(c, jj_eval(c, n->a), n->name, n);
    case JN_ITEM: {
        jj_value_t *obj = jj_eval(c, n->a);
        return jj_getitem(c, obj, jj_eval(c, n->b), n);
    }
    case JN_SLICE: return eval_slice(c, n);
    case JN_CALL: return eval_call(c, n);
    case JN_FILTER: return eval_filter(c, n, jj_eval(c, n->a));
    case JN_TEST: {
        jj_value_t *v = jj_eval(c, n->a);
        jj_args_t args;
        eval_args(c, n, &args);
        charge_args(c, n, &args);
        jj_charge(c, n, jj_cost(v));
        return jv_bool(c, jj_test(c, n->name, v, &args, n) != n->negate);
    }
    case JN_BINOP: {
        jj_value_t *a = jj_eval(c, n->a);
        jj_value_t *r = binop(c, n, a, jj_eval(c, n->b));
        jj_charge(c, n, jj_cost(r)); /* what concatenation, repetition or % built */
        return r;
    }
    case JN_CMP: return compare(c, n);
    case JN_NEG:
    case JN_POS: return eval_unary(c, n);
    default: return eval_logic(c, n);
    }
}

jj_value_t *jj_eval(jj_ctx_t *c, const jj_node_t *n)
{
    step(c, n);
    enter_frame(c, n);
    const jj_node_t *outer = c->at;
    c->at = n;
    jj_value_t *v = eval_node(c, n);
    c->at = outer;
    c->frames--;
    return v;
}

/* ---- statements ---- */

static void scope_set(jj_ctx_t *c, const char *name, jj_value_t *v)
{
    jv_setc(c, c->scope->vars, name, v);
}

static void assign(jj_ctx_t *c, const jj_node_t *target, jj_value_t *v)
{
    if (target->kind == JN_NAME) {
        scope_set(c, target->name, v);
        return;
    }
    jj_value_t *items = jj_iterable(c, v, target);
    if (items->u.list.n != target->n_kids)
        jj_fail(c, target, TDM_EINVALID, "ValueError: %s values to unpack (expected %zu, got %zu)",
                items->u.list.n > target->n_kids ? "too many" : "not enough", target->n_kids,
                items->u.list.n);
    for (size_t k = 0; k < target->n_kids; k++)
        scope_set(c, target->kids[k]->name, items->u.list.items[k]);
}

static void exec_set(jj_ctx_t *c, const jj_node_t *n, jj_value_t *v)
{
    if (n->a->kind != JN_NSATTR) {
        assign(c, n->a, v);
        return;
    }
    jj_value_t *ns = jj_lookup(c, n->a->name);
    if (ns->kind != JV_NS)
        jj_fail(c, n, TDM_EINVALID, "cannot assign attribute on non-namespace object");
    jv_setc(c, ns, n->a->a->name, v);
}

static jj_value_t *apply_filters(jj_ctx_t *c, const jj_node_t *f, jj_value_t *v)
{
    if (!f)
        return v;
    enter_frame(c, f);
    v = apply_filters(c, f->a, v);
    v = eval_filter(c, f, v);
    c->frames--;
    return v;
}

static jj_value_t *filtered_items(jj_ctx_t *c, const jj_node_t *n, jj_value_t *items)
{
    if (!n->c)
        return items;
    jj_value_t *kept = jv_list(c);
    for (size_t k = 0; k < items->u.list.n; k++) {
        assign(c, n->a, items->u.list.items[k]);
        if (jv_truthy(jj_eval(c, n->c)))
            jv_push(c, kept, items->u.list.items[k]);
    }
    return kept;
}

static void set_loop(jj_ctx_t *c, jj_value_t *items, size_t k)
{
    size_t n = items->u.list.n;
    jj_value_t *loop = jv_dict(c);
    jv_setc(c, loop, "index", jv_int(c, (int64_t)k + 1));
    jv_setc(c, loop, "index0", jv_int(c, (int64_t)k));
    jv_setc(c, loop, "revindex", jv_int(c, (int64_t)(n - k)));
    jv_setc(c, loop, "revindex0", jv_int(c, (int64_t)(n - k - 1)));
    jv_setc(c, loop, "first", jv_bool(c, k == 0));
    jv_setc(c, loop, "last", jv_bool(c, k + 1 == n));
    jv_setc(c, loop, "length", jv_int(c, (int64_t)n));
    jv_setc(c, loop, "depth", jv_int(c, 1));
    jv_setc(c, loop, "depth0", jv_int(c, 0));
    jv_setc(c, loop, "previtem",
            k ? items->u.list.items[k - 1] : jv_undef(c, "there is no previous item"));
    jv_setc(c, loop, "nextitem",
            k + 1 < n ? items->u.list.items[k + 1] : jv_undef(c, "there is no next item"));
    jj_value_t *cycle = jv_new(c, JV_FUNC);
    cycle->u.func.fn = jj_loop_cycle;
    cycle->u.func.self = jv_int(c, (int64_t)k);
    cycle->u.func.name = "cycle";
    jv_setc(c, loop, "cycle", cycle);
    scope_set(c, "loop", loop);
}

static void exec_for(jj_ctx_t *c, const jj_node_t *n)
{
    jj_value_t *items = jj_iterable(c, jj_eval(c, n->b), n->b);
    jj_scope_t *scope = jj_alloc(&c->arena, sizeof *scope);
    if (!scope)
        jj_fail_memory(c, n);
    scope->parent = c->scope;
    scope->vars = jv_dict(c);
    c->scope = scope;
    items = filtered_items(c, n, items);
    for (size_t k = 0; k < items->u.list.n; k++) {
        set_loop(c, items, k);
        assign(c, n->a, items->u.list.items[k]);
        jj_exec(c, n->body);
        int ctl = c->loop_ctl;
        c->loop_ctl = LOOP_NONE;
        if (ctl == LOOP_BREAK)
            break;
    }
    c->scope = scope->parent;
    if (items->u.list.n == 0 && n->orelse)
        jj_exec(c, n->orelse);
}

/* {% call %}: the called macro gets caller, a macro rendering this block's body. */
static void exec_call_block(jj_ctx_t *c, const jj_node_t *n)
{
    jj_value_t *caller = jv_new(c, JV_FUNC);
    caller->u.func.macro = n; /* its kids are the parameters, its body the body */
    caller->u.func.name = "caller";
    caller->u.func.closure = c->scope;
    jj_value_t *f = jj_eval(c, n->a->a);
    jj_args_t args;
    eval_args(c, n->a, &args);
    args.kw_names[args.n_kw] = "caller"; /* eval_args leaves room for one more */
    args.kw[args.n_kw++] = caller;
    jj_value_t *r = jv_to_str(c, jj_call_value(c, f, &args, n));
    emit(c, n, r->u.str.s, r->u.str.n);
}

static void exec_macro(jj_ctx_t *c, const jj_node_t *n)
{
    jj_value_t *f = jv_new(c, JV_FUNC);
    f->u.func.macro = n;
    f->u.func.name = n->name;
    f->u.func.closure = c->scope;
    scope_set(c, n->name, f);
}

static void exec_node(jj_ctx_t *c, const jj_node_t *n)
{
    switch (n->kind) {
    case JN_BODY:
        for (size_t k = 0; k < n->n_kids && c->loop_ctl == LOOP_NONE; k++)
            jj_exec(c, n->kids[k]);
        return;
    case JN_TEXT: emit(c, n, n->text, n->text_len); return;
    case JN_OUTPUT: {
        jj_value_t *v = jv_to_str(c, jj_eval(c, n->a));
        emit(c, n, v->u.str.s, v->u.str.n);
        return;
    }
    case JN_IF:
        if (jv_truthy(jj_eval(c, n->a)))
            jj_exec(c, n->body);
        else if (n->orelse)
            jj_exec(c, n->orelse);
        return;
    case JN_FOR: exec_for(c, n); return;
    case JN_SET: exec_set(c, n, jj_eval(c, n->b)); return;
    case JN_SET_BLOCK: exec_set(c, n, apply_filters(c, n->c, capture(c, n->body))); return;
    case JN_MACRO: exec_macro(c, n); return;
    case JN_CALL_BLOCK: exec_call_block(c, n); return;
    case JN_FILTER_BLOCK: {
        jj_value_t *v = apply_filters(c, n->c, capture(c, n->body));
        emit(c, n, v->u.str.s, v->u.str.n);
        return;
    }
    case JN_BREAK: c->loop_ctl = LOOP_BREAK; return;
    case JN_CONTINUE: c->loop_ctl = LOOP_CONTINUE; return;
    default: jj_fail(c, n, TDM_EINTERNAL, "not a statement");
    }
}

void jj_exec(jj_ctx_t *c, const jj_node_t *n)
{
    step(c, n);
    enter_frame(c, n);
    const jj_node_t *outer = c->at;
    c->at = n;
    exec_node(c, n);
    c->at = outer;
    c->frames--;
}
