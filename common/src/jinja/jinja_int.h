/* jinja_int.h - the Jinja renderer's shared internals: arena, syntax tree, values. */
#ifndef TANDEM_JINJA_INT_H
#define TANDEM_JINJA_INT_H

#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "tandem/jinja.h"

/* Bump allocator: a template's tree and a rendering's values live and die together. */
typedef struct jj_arena {
    struct jj_chunk *head;
    size_t used_bytes;  /* all chunks together */
    size_t given_bytes; /* handed out by jj_alloc */
    size_t max_bytes;   /* 0: no bound */
} jj_arena_t;

void *jj_alloc(jj_arena_t *a, size_t n); /* zeroed; NULL when out of memory or over bound */
void jj_arena_free(jj_arena_t *a);

typedef enum jj_node_kind {
    /* statements */
    JN_TEXT,
    JN_OUTPUT,
    JN_IF,
    JN_FOR,
    JN_SET,
    JN_SET_BLOCK,
    JN_MACRO,
    JN_CALL_BLOCK,
    JN_FILTER_BLOCK,
    JN_BREAK,
    JN_CONTINUE,
    JN_BODY,
    /* expressions */
    JN_CONST,
    JN_NAME,
    JN_LIST,
    JN_TUPLE,
    JN_DICT,
    JN_ATTR,
    JN_ITEM,
    JN_SLICE,
    JN_CALL,
    JN_FILTER,
    JN_TEST,
    JN_BINOP,
    JN_NOT,
    JN_NEG,
    JN_POS,
    JN_AND,
    JN_OR,
    JN_COND,
    JN_CMP,
    JN_KWARG,
    JN_NSATTR
} jj_node_kind_t;

struct jj_value;

typedef struct jj_node {
    jj_node_kind_t kind;
    int line, col;
    int op;                    /* JN_BINOP, JN_CMP: the operator token */
    const char *name;          /* JN_NAME, JN_ATTR, JN_FILTER, JN_TEST, JN_KWARG, JN_MACRO... */
    const char *text;          /* JN_TEXT */
    size_t text_len;           /* JN_TEXT */
    struct jj_value *value;    /* JN_CONST */
    struct jj_node *a, *b, *c; /* operands; JN_FOR: a target, b iter, c filter */
    struct jj_node **kids;     /* JN_BODY statements, JN_LIST items, call arguments */
    size_t n_kids;
    struct jj_node *body, *orelse; /* JN_IF, JN_FOR, JN_MACRO, ... */
    bool negate;                   /* JN_TEST: is not; JN_CMP: not in */
    unsigned height;               /* expressions: 1 + the tallest operand (parser bounds it) */
} jj_node_t;

/* Parses source into a JN_BODY; NULL with err set. The tree lives in arena. */
jj_node_t *jj_parse(jj_arena_t *arena, const char *src, size_t len, const tdm_jinja_options_t *opt,
                    tdm_error_t *err);

typedef enum jj_kind {
    JV_UNDEF,
    JV_NONE,
    JV_BOOL,
    JV_INT,
    JV_FLOAT,
    JV_STR,
    JV_LIST,
    JV_DICT,
    JV_FUNC,
    JV_NS
} jj_kind_t;

struct jj_ctx;
typedef struct jj_value jj_value_t;

/* A call's arguments, evaluated. */
typedef struct jj_args {
    jj_value_t **pos;
    size_t n_pos;
    const char **kw_names;
    jj_value_t **kw;
    size_t n_kw;
} jj_args_t;

typedef jj_value_t *(*jj_builtin_fn)(struct jj_ctx *c, jj_value_t *self, jj_args_t *args,
                                     const jj_node_t *at);

struct jj_value {
    jj_kind_t kind;
    bool is_tuple; /* JV_LIST: a tuple (repr with parentheses) */
    bool is_safe;  /* JV_STR: marked safe (no effect without autoescape) */
    bool is_gen;   /* JV_LIST: a generator (map, select...): always true, no len(), no JSON */
    union {
        bool b;
        int64_t i;
        double f;
        struct {
            const char *s;
            size_t n;
        } str;
        struct {
            jj_value_t **items;
            size_t n, cap;
        } list;
        struct {
            jj_value_t **keys, **vals;
            size_t n, cap;
        } dict; /* JV_DICT and JV_NS: insertion order kept */
        struct {
            jj_builtin_fn fn;
            jj_value_t *self;
            const jj_node_t *macro;
            const char *name;
            struct jj_scope *closure;
        } func;
        const char *undef_hint; /* JV_UNDEF: the message an attribute access would give */
    } u;
};

typedef struct jj_scope {
    struct jj_scope *parent;
    jj_value_t *vars; /* a JV_DICT */
} jj_scope_t;

/* A rendering's state. Errors longjmp to the render entry point. */
typedef struct jj_ctx {
    jj_arena_t arena;
    char *out;
    size_t out_len, out_cap;
    tdm_jinja_limits_t limits;
    uint64_t steps;
    unsigned depth;       /* nested macro calls */
    unsigned frames;      /* jj_eval / jj_exec calls now on the stack */
    uintptr_t stack_base; /* a local's address where the rendering began */
    size_t arena_base;    /* arena bytes the globals and the context took */
    const jj_node_t *at;  /* the node being evaluated or run (for errors without one) */
    int64_t now;
    jmp_buf fail;
    int code;
    bool raised;
    tdm_error_t *err;
    jj_scope_t *scope;
    jj_value_t *globals;
    int loop_ctl; /* a break or continue on its way to its loop */
} jj_ctx_t;

/* The renderer's recursion bound: jj_eval and jj_exec calls open at once, across macro calls
 * and expressions (jinja2 stops at Python's 1000 frames, about 250 to 500 links of a chain).
 * 3000 frames used 0.67 MiB of stack (about 225 bytes a frame with the helpers between them;
 * RelWithDebInfo, x86-64, test_jinja's deep_nesting), well inside the 8 MiB stacks the
 * router's loop, its HTTP threads and the nodes' threads run on (pthread defaults);
 * JJ_MAX_STACK_BYTES backs the count up where frames are bigger (sanitizers, builtins). */
#define JJ_MAX_FRAMES 3000
#define JJ_MAX_STACK_BYTES (3u << 19)

_Noreturn void jj_fail(jj_ctx_t *c, const jj_node_t *at, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* An allocation failed: the memory limit, named with at's place (NULL: the node being
 * evaluated), or the machine's memory. */
_Noreturn void jj_fail_memory(jj_ctx_t *c, const jj_node_t *at);

/* The first occurrence of needle (nn bytes, > 0) in hay (hn bytes); NULL when none. Linear in
 * hn + nn (glibc's two-way memmem), so a scan costs what jj_cost charges for it. */
const char *jj_find(const char *hay, size_t hn, const char *needle, size_t nn);

/* The cost model (docs/api.md "Render limits"): a step is one expression evaluated or one
 * statement run, and an operation that scans, copies or builds a value also pays for what it
 * touches: one step per JJ_BYTES_PER_STEP bytes of a string and one per item of a list or
 * dict (jj_cost), for its operands and its result. So max_steps bounds the CPU time. */
#define JJ_BYTES_PER_STEP 4
/* and every JJ_ALLOC_BYTES_PER_STEP bytes of values the rendering allocates count as a step:
 * building values is where a runaway template spends its time (about 2.6 ms a MiB). */
#define JJ_ALLOC_BYTES_PER_STEP 4

/* Adds steps to the rendering's count; fails at at (TDM_ERESOURCE) past max_steps. */
void jj_charge(jj_ctx_t *c, const jj_node_t *at, uint64_t steps);
/* What touching v costs, in steps (not nested values: those pay when they are touched). */
uint64_t jj_cost(const jj_value_t *v);
/* a == b as jv_equal, charging the rendering for every value and byte compared and bounded in
 * depth like the renderer's frames. */
bool jj_equal(jj_ctx_t *c, const jj_node_t *at, const jj_value_t *a, const jj_value_t *b);

/* values (jinja_value.c) */
jj_value_t *jv_new(jj_ctx_t *c, jj_kind_t kind);
jj_value_t *jv_undef(jj_ctx_t *c, const char *hint);
jj_value_t *jv_none(jj_ctx_t *c);
jj_value_t *jv_bool(jj_ctx_t *c, bool b);
jj_value_t *jv_int(jj_ctx_t *c, int64_t i);
jj_value_t *jv_float(jj_ctx_t *c, double f);
jj_value_t *jv_str(jj_ctx_t *c, const char *s, size_t n); /* copies */
jj_value_t *jv_cstr(jj_ctx_t *c, const char *s);
jj_value_t *jv_list(jj_ctx_t *c);
jj_value_t *jv_dict(jj_ctx_t *c);
void jv_push(jj_ctx_t *c, jj_value_t *list, jj_value_t *v);
void jv_set(jj_ctx_t *c, jj_value_t *dict, jj_value_t *key, jj_value_t *v);
void jv_setc(jj_ctx_t *c, jj_value_t *dict, const char *key, jj_value_t *v);
jj_value_t *jv_get(const jj_value_t *dict, const jj_value_t *key); /* NULL when absent */
jj_value_t *jv_getc(const jj_value_t *dict, const char *key);
jj_value_t *jv_from_json(jj_ctx_t *c, const json_t *j);
bool jv_truthy(const jj_value_t *v);
bool jv_equal(const jj_value_t *a, const jj_value_t *b);
int jv_compare(jj_ctx_t *c, const jj_node_t *at, const jj_value_t *a, const jj_value_t *b);
bool jv_is_str(const jj_value_t *v, const char *s);
const char *jv_type_name(const jj_value_t *v);

/* A growable byte string for building output and str()/repr(). */
typedef struct jj_buf {
    jj_ctx_t *c;
    char *p;
    size_t n, cap;
    bool ascii;           /* jv_write_json: ensure_ascii */
    bool sort_keys;       /* jv_write_json: sort_keys */
    const char *item_sep; /* jv_write_json: separators[0]; NULL: ", " (no indent) or "," */
    const char *key_sep;  /* jv_write_json: separators[1]; NULL: ": " */
    unsigned depth;       /* containers being written (a namespace may hold itself) */
} jj_buf_t;

void jb_put(jj_buf_t *b, const char *s, size_t n);
void jb_puts(jj_buf_t *b, const char *s);
jj_value_t *jb_value(jj_buf_t *b);
void jv_write_str(jj_buf_t *b, const jj_value_t *v);                        /* Python str() */
void jv_write_repr(jj_buf_t *b, const jj_value_t *v);                       /* Python repr() */
int jv_write_json(jj_buf_t *b, const jj_value_t *v, int indent, int level); /* json.dumps */
jj_value_t *jv_to_str(jj_ctx_t *c, const jj_value_t *v);

/* evaluation (jinja_eval.c) */
jj_value_t *jj_eval(jj_ctx_t *c, const jj_node_t *n);
void jj_exec(jj_ctx_t *c, const jj_node_t *n);
jj_value_t *jj_lookup(jj_ctx_t *c, const char *name);
jj_value_t *jj_call_value(jj_ctx_t *c, jj_value_t *f, jj_args_t *args, const jj_node_t *at);
jj_value_t *jj_getattr(jj_ctx_t *c, jj_value_t *obj, const char *name, const jj_node_t *at);
jj_value_t *jj_getitem(jj_ctx_t *c, jj_value_t *obj, jj_value_t *key, const jj_node_t *at);
jj_value_t *jj_iterable(jj_ctx_t *c, jj_value_t *v, const jj_node_t *at); /* as a list */

/* s as markupsafe's escape() writes it (& < > ' " as entities) into b. */
void jj_put_escaped(jj_buf_t *b, const jj_value_t *s);

/* v as a string in upper ('U') or lower ('L') case, capitalized ('C'), in Python's
 * str.title ('T') or jinja2's title filter ('J'). */
jj_value_t *jj_case_map(jj_ctx_t *c, jj_value_t *v, int mode);

/* builtins (jinja_builtins.c) */
/* fmt % args (a tuple, or one value) with %s %r %d %i %f %%, as Python's str % formatting. */
jj_value_t *jj_percent_format(jj_ctx_t *c, jj_value_t *fmt, jj_value_t *args, const jj_node_t *at);
/* loop.cycle(a, b, ...): self is the loop's index0. */
jj_value_t *jj_loop_cycle(jj_ctx_t *c, jj_value_t *self, jj_args_t *args, const jj_node_t *at);
jj_value_t *jj_filter(jj_ctx_t *c, const char *name, jj_value_t *v, jj_args_t *args,
                      const jj_node_t *at);
bool jj_test(jj_ctx_t *c, const char *name, jj_value_t *v, jj_args_t *args, const jj_node_t *at);
jj_value_t *jj_method(jj_ctx_t *c, jj_value_t *obj, const char *name, const jj_node_t *at);
void jj_add_globals(jj_ctx_t *c, jj_value_t *globals);
jj_value_t *jj_arg(jj_args_t *a, size_t pos, const char *kw); /* NULL when not given */
/* s (a string) stripped of the bytes in chars (NULL or not a string: Python's whitespace) at
 * the left and/or right, as str.strip/lstrip/rstrip. */
jj_value_t *jj_strip(jj_ctx_t *c, jj_value_t *s, jj_value_t *chars, bool left, bool right);

#endif
