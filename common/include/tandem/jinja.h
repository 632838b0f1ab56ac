/* jinja.h - a Jinja template renderer byte-equal to Python's jinja2 3.1 on chat templates.
 *
 * A template is compiled once (tdm_jinja_new) into a syntax tree and rendered any number of
 * times, from any number of threads (rendering does not change the template), with a context
 * given as a jansson object. The language is the part of Jinja that models' chat templates use
 * (docs/models.md lists it), with jinja2's default Undefined (a missing name or key renders as
 * "" and is false) and Python's value semantics (repr/str, int/float arithmetic, code-point
 * string order). Rendering is bounded: output bytes, evaluation steps and call depth, each
 * failing with the template's line:column.
 */
#ifndef TANDEM_JINJA_H
#define TANDEM_JINJA_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"

typedef struct tdm_jinja tdm_jinja_t;

/* How the source is cut into text and tags; transformers' apply_chat_template sets both. */
typedef struct tdm_jinja_options {
    bool trim_blocks;   /* drop the first newline after a block or comment tag */
    bool lstrip_blocks; /* drop spaces and tabs before a block or comment tag on its line */
} tdm_jinja_options_t;

/* What one rendering may use; 0 means the default in brackets.
 *
 * Steps bound the CPU time (templates may come from a request). The cost model: each expression
 * evaluated and each statement run is one step; on top, an operation pays for what it scans,
 * copies or builds: one step per 4 bytes of a string and one per item of a list or dict among
 * its operands and its result (comparisons, 'in', concatenation and repetition, slices, every
 * filter, test and method call); a lookup in a dict of n keys n/8; each value compared inside a
 * list or dict 1 more; output 1 per 4 bytes; and every 4 bytes of values the rendering
 * allocates (besides the context) one. A rendering that reaches the default limit has spent
 * at most about 0.1 s of CPU (x86-64, measured on 1 MB strings and 100 000-item lists); the
 * chat templates of docs/models.md use well under 5% of it.
 *
 * Beside these: an expression nests at most 256 levels deep (a compile error), the renderer
 * keeps at most 3000 frames open (nested macro calls times expression depth), and a rendering's
 * values take at most 64 times max_output_bytes plus 64 MiB (128 MiB by default). */
typedef struct tdm_jinja_limits {
    size_t max_output_bytes; /* bytes of output [1 MiB] */
    uint64_t max_steps;      /* steps, as above [10 000 000] */
    unsigned max_depth;      /* nested macro calls [200] */
} tdm_jinja_limits_t;

/* One rendering's inputs besides the context. */
typedef struct tdm_jinja_render_options {
    tdm_jinja_limits_t limits;
    int64_t now; /* seconds since the epoch that strftime_now() formats (UTC); < 0: the clock */
} tdm_jinja_render_options_t;

/* Compiles len bytes of template source; name is used in no message yet (kept for callers'
 * logs). A single trailing newline is dropped, as jinja2 does. opt NULL: both options false.
 * Returns the template (caller frees with tdm_jinja_destroy) or NULL: TDM_EINVALID with
 * "line:column: what" in err for a syntax error or for nesting past the bounds (blocks and
 * parentheses 200 levels, an expression's tree 256: "expression nested too deeply"),
 * TDM_ERESOURCE when out of memory. */
tdm_jinja_t *tdm_jinja_new(const char *src, size_t len, const char *name,
                           const tdm_jinja_options_t *opt, tdm_error_t *err);

/* Frees the template and nulls *self_p; accepts NULL and *self_p NULL. */
void tdm_jinja_destroy(tdm_jinja_t **self_p);

/* Whether the template names the variable `name` anywhere (reads it, tests it, or assigns it),
 * as jinja2.meta.find_undeclared_variables would list a variable the template reads: e.g.
 * whether a chat template renders `tools` at all. False for NULL arguments. Cannot fail. */
bool tdm_jinja_reads(const tdm_jinja_t *self, const char *name);

/* Whether the template's source holds the bytes of text anywhere (in its literal text, a
 * string literal or a comment): how the gateway tells a template's tool-call and reasoning
 * markup ("<think>", "[TOOL_CALLS]", docs/models.md). False for NULL or empty arguments.
 * Cannot fail. */
bool tdm_jinja_source_has(const tdm_jinja_t *self, const char *text);

/* Renders the template with context (a JSON object: its members are the template's variables;
 * NULL: none) and opt (NULL: defaults). On success *out is a NUL-terminated string of *out_len
 * bytes that the caller frees with free(). Errors (*out NULL): TDM_EINVALID for what jinja2
 * would raise, with "line:column: " and jinja2's message in err ("line:column: 'x' is
 * undefined"), except raise_exception(msg) whose message is msg exactly and which sets
 * *raised (when raised is not NULL); TDM_ERESOURCE when a limit is passed (naming it and the
 * line:column: "template step limit", "template output limit", "template recursion depth
 * limit" for macro calls, "template recursion limit (3000 frames)" for expressions and values
 * nested within them, "template memory limit (N bytes)" for the values), or a value to print
 * nests past 500 levels (without a place).
 * Integers are 64-bit: a result outside that range is TDM_EINVALID ("OverflowError: ..."). */
int tdm_jinja_render(const tdm_jinja_t *self, const json_t *context,
                     const tdm_jinja_render_options_t *opt, char **out, size_t *out_len,
                     bool *raised, tdm_error_t *err);

#endif
