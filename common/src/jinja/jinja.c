/* jinja.c - tdm_jinja_t: a compiled template and its rendering entry point. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "jinja_int.h"

struct tdm_jinja {
    jj_arena_t arena; /* the source copy and the tree */
    jj_node_t *root;
    char *name;
    const char *src; /* the source copy (in arena), src_len bytes */
    size_t src_len;
};

tdm_jinja_t *tdm_jinja_new(const char *src, size_t len, const char *name,
                           const tdm_jinja_options_t *opt, tdm_error_t *err)
{
    tdm_jinja_t *t = calloc(1, sizeof *t);
    if (!t) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    char *copy = jj_alloc(&t->arena, len + 1);
    t->name = strdup(name ? name : "");
    if (!copy || !t->name) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        goto out_free;
    }
    if (len)
        memcpy(copy, src, len);
    copy[len] = '\0';
    t->src = copy;
    t->src_len = len;
    t->root = jj_parse(&t->arena, copy, len, opt, err);
    if (!t->root)
        goto out_free;
    return t;
out_free:
    tdm_jinja_destroy(&t);
    return NULL;
}

/* Whether the tree under n holds a JN_NAME node called name; depth bounds the recursion (the
 * parser's nesting is bounded, this is a second guard). */
static bool node_reads(const jj_node_t *n, const char *name, int depth)
{
    if (!n || depth > 10000)
        return false;
    if (n->kind == JN_NAME && n->name && strcmp(n->name, name) == 0)
        return true;
    if (node_reads(n->a, name, depth + 1) || node_reads(n->b, name, depth + 1) ||
        node_reads(n->c, name, depth + 1) || node_reads(n->body, name, depth + 1) ||
        node_reads(n->orelse, name, depth + 1))
        return true;
    for (size_t i = 0; i < n->n_kids; i++)
        if (node_reads(n->kids[i], name, depth + 1))
            return true;
    return false;
}

bool tdm_jinja_reads(const tdm_jinja_t *self, const char *name)
{
    return self && name && node_reads(self->root, name, 0);
}

bool tdm_jinja_source_has(const tdm_jinja_t *self, const char *text)
{
    if (!self || !text || !text[0])
        return false;
    size_t m = strlen(text);
    for (size_t i = 0; i + m <= self->src_len; i++)
        if (memcmp(self->src + i, text, m) == 0)
            return true;
    return false;
}

void tdm_jinja_destroy(tdm_jinja_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_jinja_t *t = *self_p;
    jj_arena_free(&t->arena);
    free(t->name);
    free(t);
    *self_p = NULL;
}

static void set_limits(jj_ctx_t *c, const tdm_jinja_render_options_t *opt)
{
    tdm_jinja_limits_t l = opt ? opt->limits : (tdm_jinja_limits_t){0};
    c->limits.max_output_bytes = l.max_output_bytes ? l.max_output_bytes : 1u << 20;
    c->limits.max_steps = l.max_steps ? l.max_steps : 10000000;
    c->limits.max_depth = l.max_depth ? l.max_depth : 200;
    /* values: a generous multiple of the output, so a runaway loop stops on memory too */
    c->arena.max_bytes = 64 * c->limits.max_output_bytes + (64u << 20);
    c->now = opt && opt->now >= 0 ? opt->now : (int64_t)time(NULL);
}

static int render(jj_ctx_t *c, const tdm_jinja_t *self, const json_t *context)
{
    if (setjmp(c->fail))
        return c->code;
    c->globals = jv_dict(c);
    jj_add_globals(c, c->globals);
    jj_scope_t *root = jj_alloc(&c->arena, sizeof *root);
    if (!root)
        jj_fail_memory(c, NULL);
    root->vars = context && json_is_object(context) ? jv_from_json(c, context) : jv_dict(c);
    c->scope = root;
    c->arena_base = c->arena.given_bytes;
    jj_exec(c, self->root);
    return 0;
}

int tdm_jinja_render(const tdm_jinja_t *self, const json_t *context,
                     const tdm_jinja_render_options_t *opt, char **out, size_t *out_len,
                     bool *raised, tdm_error_t *err)
{
    *out = NULL;
    *out_len = 0;
    if (raised)
        *raised = false;
    jj_ctx_t *c = calloc(1, sizeof *c);
    if (!c)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    set_limits(c, opt);
    c->err = err;
    char base;
    c->stack_base = (uintptr_t)&base;
    int rc = render(c, self, context);
    if (rc == 0) {
        *out = malloc(c->out_len + 1);
        if (!*out) {
            rc = tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        } else {
            if (c->out_len)
                memcpy(*out, c->out, c->out_len);
            (*out)[c->out_len] = 0;
            *out_len = c->out_len;
        }
    } else if (raised) {
        *raised = c->raised;
    }
    jj_arena_free(&c->arena);
    free(c);
    return rc;
}
