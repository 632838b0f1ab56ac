/* json_schema.h - JSON Schema (draft 2020-12 and the draft-07 forms real schemas use) to a
 * GBNF grammar (tandem/grammar.h) that matches exactly the JSON texts the schema allows, in
 * the supported subset. Anything outside the subset is refused with the keyword's JSON
 * pointer, never weakened silently. Property order: the order of definition in `properties`
 * (as LLGuidance and XGrammar do; merged schemas in document order). Whitespace: see
 * docs/structured-output.md. A subschema whose grammar would pass TDM_GRAMMAR_MAX_TEXT_BYTES
 * is refused with its pointer; a router also checks the parsed grammar with
 * tdm_grammar_check (tandem/grammar.h) before admitting a request.
 *
 * The compilers are pure functions (no shared state: any thread may call them); subschemas
 * nest at most 64 deep (deeper is refused), which needs about 192 KiB of stack.
 */
#ifndef TANDEM_JSON_SCHEMA_H
#define TANDEM_JSON_SCHEMA_H

#include <stddef.h>

#include "tandem/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Compiles the schema in json[len] (UTF-8 JSON text) to GBNF text in *out (appended; start
 * rule `root`). Returns 0, or TDM_EINVALID with "<JSON pointer>: what" ("/properties/a/
 * propertyNames: not supported", "/minItems: must be a non-negative integer", "/$ref:
 * '#/$defs/x' not found", "invalid JSON at line L, column C: ..."), or TDM_ERESOURCE on out of
 * memory. On failure *out is left as it was. The caller owns *out (tdm_buf_free). */
int tdm_json_schema_to_gbnf(const char *json, size_t len, tdm_buf_t *out, tdm_error_t *err);

/* Like tdm_json_schema_to_gbnf, but the start rule is named `rule` and every other rule the
 * schema needs is named `<rule>-...`, so several schemas compose into one grammar (tool calls:
 * `root ::= "<tool_call>" call-0 "</tool_call>"` plus each function's rules). `rule` is a GBNF
 * rule name ([a-zA-Z0-9-]+). Same errors. */
int tdm_json_schema_to_gbnf_rule(const char *json, size_t len, const char *rule, tdm_buf_t *out,
                                 tdm_error_t *err);

/* Appends the GBNF of OpenAI's `json_object` mode (any JSON object) to *out (start rule
 * `root`). Returns 0 or TDM_ERESOURCE on out of memory. */
int tdm_json_object_gbnf(tdm_buf_t *out, tdm_error_t *err);

/* Appends `rule ::= ...` (and nothing else) matching exactly the texts the regular expression
 * re[len] matches as a whole (anchors ^ $ at the ends are accepted and change nothing). The
 * subset: literals, escapes (\d \D \w \W \s \S \n \t \r \f \v \0 \xHH \uHHHH, escaped
 * punctuation), classes with ranges and negation, `.` (any character but newline), groups
 * `( )` `(?: )` `(?<name> )`, alternation, `* + ? {m} {m,} {m,n}` (lazy forms too), anchors at
 * the ends of top-level alternatives (docs/structured-output.md). Returns 0, TDM_EINVALID with
 * "regex: what (at offset N)" (backreferences, lookaround, \b, flags, anchors inside, syntax
 * errors, a rule name that is not [a-zA-Z0-9-]+), or TDM_ERESOURCE on out of memory. */
int tdm_regex_to_gbnf_rule(const char *re, size_t len, const char *rule, tdm_buf_t *out,
                           tdm_error_t *err);

/* Appends `root ::= "c0" | "c1" | ...`: exactly one of the n strings (each a NUL-terminated
 * UTF-8 text taken literally, not JSON-escaped). Returns 0, TDM_EINVALID when n is 0 or an
 * entry is NULL or not UTF-8, or TDM_ERESOURCE on out of memory. */
int tdm_choice_to_gbnf(const char *const *choices, size_t n, tdm_buf_t *out, tdm_error_t *err);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_JSON_SCHEMA_H */
