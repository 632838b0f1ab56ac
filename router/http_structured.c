/* http_structured.c - the structured-output fields of OpenAI requests translated to the client
 * request's constraint (tandem/client.h constraint_kind / constraint): OpenAI's
 * `response_format` ({"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
 * "schema", "strict", "description"}}) and vLLM's `guided_json`, `guided_regex`,
 * `guided_choice`, `guided_grammar` and `structured_outputs` ({json, regex, choice, grammar,
 * json_object}).
 *
 * One source at a time: a second one is refused (400 naming it), never silently preferred. The
 * router compiles what is sent here (tdm_constraint_compile); its refusals name the field
 * "constraint", which http_generate.c maps back to the OpenAI parameter recorded in
 * oai_req_t.constraint_param.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http.h"
#include "http_openai.h"

/* What one field asks for. */
typedef struct source {
    const char *param; /* the OpenAI field ("response_format", "structured_outputs.json") */
    int kind;          /* tdm_client_constraint_t; NONE: the field asks for nothing */
    json_t *value;     /* the schema / regex / choices / grammar (borrowed from the body) */
} source_t;

/* An INVALID_ARGUMENT naming param. */
/* The value of a member, NULL when absent or null. */
static json_t *member(const json_t *obj, const char *name)
{
    json_t *v = json_object_get(obj, name);
    return v && !json_is_null(v) ? v : NULL;
}

/* Checks that v (the value of param) has the JSON type kind needs: a schema is an object (or a
 * string holding one, as vLLM takes guided_json), a regex or a grammar a non-empty string,
 * choices a non-empty array of strings. Returns 0 or a refusal naming param. */
static int check_value(const source_t *s, tdm_error_t *err)
{
    const json_t *v = s->value;
    switch (s->kind) {
    case TDM_CLIENT_CONSTRAINT_JSON_SCHEMA:
        if (json_is_object(v) || (json_is_string(v) && json_string_length(v) > 0))
            return TDM_OK;
        return tdm_error_set_field(err, TDM_EINVALID, s->param, "%s must be a JSON Schema object",
                                   s->param);
    case TDM_CLIENT_CONSTRAINT_REGEX:
    case TDM_CLIENT_CONSTRAINT_GRAMMAR:
        if (json_is_string(v) && json_string_length(v) > 0 &&
            strlen(json_string_value(v)) == json_string_length(v))
            return TDM_OK;
        return tdm_error_set_field(err, TDM_EINVALID, s->param, "%s must be a non-empty string",
                                   s->param);
    case TDM_CLIENT_CONSTRAINT_CHOICE:
        if (!json_is_array(v) || json_array_size(v) == 0)
            return tdm_error_set_field(err, TDM_EINVALID, s->param,
                                       "%s must be a non-empty array of strings", s->param);
        for (size_t i = 0; i < json_array_size(v); i++)
            if (!json_is_string(json_array_get(v, i)))
                return tdm_error_set_field(err, TDM_EINVALID, s->param, "%s[%zu] must be a string",
                                           s->param, i);
        return TDM_OK;
    }
    return TDM_OK;
}

/* response_format: text (nothing), json_object, or json_schema with its schema. */
static int from_response_format(json_t *rf, source_t *s, tdm_error_t *err)
{
    const char *p = "response_format";
    const char *type = json_is_object(rf) ? json_string_value(json_object_get(rf, "type")) : NULL;
    *s = (source_t){p, TDM_CLIENT_CONSTRAINT_NONE, NULL};
    if (!type)
        return tdm_error_set_field(err, TDM_EINVALID, p,
                                   "response_format must be an object with a string type");
    if (strcmp(type, "text") == 0)
        return TDM_OK;
    if (strcmp(type, "json_object") == 0) {
        s->kind = TDM_CLIENT_CONSTRAINT_JSON_OBJECT;
        return TDM_OK;
    }
    if (strcmp(type, "json_schema") != 0)
        return tdm_error_set_field(
            err, TDM_EINVALID, p,
            "response_format.type must be text, json_object or json_schema, got '%s'", type);
    json_t *js = member(rf, "json_schema");
    if (!json_is_object(js))
        return tdm_error_set_field(err, TDM_EINVALID, p,
                                   "response_format.json_schema must be an object with the schema");
    json_t *name = member(js, "name"), *strict = member(js, "strict");
    json_t *desc = member(js, "description");
    if ((name && !json_is_string(name)) || (desc && !json_is_string(desc)))
        return tdm_error_set_field(
            err, TDM_EINVALID, p,
            "response_format.json_schema.name and .description must be strings");
    if (strict && !json_is_boolean(strict))
        return tdm_error_set_field(err, TDM_EINVALID, p,
                                   "response_format.json_schema.strict must be a boolean");
    s->kind = TDM_CLIENT_CONSTRAINT_JSON_SCHEMA;
    s->value = member(js, "schema");
    if (!s->value) /* OpenAI: no schema = any JSON object */
        s->kind = TDM_CLIENT_CONSTRAINT_JSON_OBJECT;
    return TDM_OK;
}

/* The members of structured_outputs (vLLM's StructuredOutputsParams) and the guided_* fields,
 * with the kind each asks for. */
static const struct {
    const char *name;
    int kind;
} guided[] =
    {
        {"guided_json", TDM_CLIENT_CONSTRAINT_JSON_SCHEMA},
        {"guided_regex", TDM_CLIENT_CONSTRAINT_REGEX},
        {"guided_choice", TDM_CLIENT_CONSTRAINT_CHOICE},
        {"guided_grammar", TDM_CLIENT_CONSTRAINT_GRAMMAR},
},
  members[] = {
      {"structured_outputs.json", TDM_CLIENT_CONSTRAINT_JSON_SCHEMA},
      {"structured_outputs.regex", TDM_CLIENT_CONSTRAINT_REGEX},
      {"structured_outputs.choice", TDM_CLIENT_CONSTRAINT_CHOICE},
      {"structured_outputs.grammar", TDM_CLIENT_CONSTRAINT_GRAMMAR},
      {"structured_outputs.json_object", TDM_CLIENT_CONSTRAINT_JSON_OBJECT},
};

/* Adds s to the one source allowed in *have; a second one is refused naming both. */
static int take(source_t *have, const source_t *s, tdm_error_t *err)
{
    if (s->kind == TDM_CLIENT_CONSTRAINT_NONE)
        return TDM_OK;
    if (have->kind != TDM_CLIENT_CONSTRAINT_NONE)
        return tdm_error_set_field(err, TDM_EINVALID, s->param,
                                   "%s conflicts with %s: give one structured-output field",
                                   s->param, have->param);
    *have = *s;
    return check_value(s, err);
}

/* structured_outputs' members are the ones above, or vLLM's choice of backend (ignored: there
 * is one); any other member (a typo, or an option that would change the grammar) is refused
 * rather than leaving the output unconstrained, and so is an object with no constraint. */
static int check_members(json_t *so, tdm_error_t *err)
{
    static const char *const ignored[] = {"backend", "disable_fallback"};
    const char *key;
    json_t *v;
    bool any = false;
    json_object_foreach(so, key, v)
    {
        bool known = false;
        for (size_t i = 0; i < sizeof members / sizeof members[0] && !known; i++)
            known = strcmp(key, members[i].name + strlen("structured_outputs.")) == 0;
        any = any || known;
        for (size_t i = 0; i < sizeof ignored / sizeof ignored[0] && !known; i++)
            known = strcmp(key, ignored[i]) == 0;
        if (!known) {
            char name[96];
            snprintf(name, sizeof name, "structured_outputs.%.64s", key);
            return tdm_error_set_field(
                err, TDM_EINVALID, name,
                "%s: not supported (give one of json, regex, choice, grammar, "
                "json_object)",
                name);
        }
    }
    if (!any)
        return tdm_error_set_field(
            err, TDM_EINVALID, "structured_outputs",
            "structured_outputs: give one of json, regex, choice, grammar, json_object");
    return TDM_OK;
}

/* structured_outputs: an object with one member. */
static int from_structured_outputs(json_t *so, source_t *have, tdm_error_t *err)
{
    if (!json_is_object(so))
        return tdm_error_set_field(err, TDM_EINVALID, "structured_outputs",
                                   "structured_outputs must be an object");
    int rc = check_members(so, err);
    if (rc != TDM_OK)
        return rc;
    for (size_t i = 0; i < sizeof members / sizeof members[0]; i++) {
        const char *name = members[i].name + strlen("structured_outputs.");
        json_t *v = member(so, name);
        if (!v || (members[i].kind == TDM_CLIENT_CONSTRAINT_JSON_OBJECT && json_is_false(v)))
            continue;
        if (members[i].kind == TDM_CLIENT_CONSTRAINT_JSON_OBJECT && !json_is_true(v))
            return tdm_error_set_field(err, TDM_EINVALID, members[i].name, "%s must be a boolean",
                                       members[i].name);
        source_t s = {members[i].name, members[i].kind, v};
        rc = take(have, &s, err);
        if (rc != TDM_OK)
            return rc;
    }
    return TDM_OK;
}

/* The source's text as the client API takes it (heap, caller frees; NULL for json_object):
 * a schema or the choices as compact JSON in the body's member order (property order is the
 * schema's meaning), a regex or grammar as given. */
static int source_text(const source_t *s, char **text, tdm_error_t *err)
{
    *text = NULL;
    if (s->kind == TDM_CLIENT_CONSTRAINT_JSON_OBJECT)
        return TDM_OK;
    if (json_is_string(s->value))
        *text = tdm_strdup(json_string_value(s->value));
    else
        *text = json_dumps(s->value, JSON_COMPACT | JSON_ENCODE_ANY);
    return *text ? TDM_OK : tdm_error_set(err, TDM_ERESOURCE, "out of memory");
}

int oai_parse_structured(oai_req_t *q, tdm_error_t *err)
{
    source_t have = {"", TDM_CLIENT_CONSTRAINT_NONE, NULL}, s;
    json_t *rf = member(q->root, "response_format");
    int rc = rf ? from_response_format(rf, &s, err) : TDM_OK;
    if (rc == TDM_OK && rf)
        rc = take(&have, &s, err);
    for (size_t i = 0; rc == TDM_OK && i < sizeof guided / sizeof guided[0]; i++) {
        json_t *v = member(q->root, guided[i].name);
        s = (source_t){guided[i].name, guided[i].kind, v};
        if (v)
            rc = take(&have, &s, err);
    }
    json_t *so = member(q->root, "structured_outputs");
    if (rc == TDM_OK && so)
        rc = from_structured_outputs(so, &have, err);
    if (rc != TDM_OK || have.kind == TDM_CLIENT_CONSTRAINT_NONE)
        return rc;
    if ((rc = source_text(&have, &q->constraint_text, err)) != TDM_OK)
        return rc;
    size_t bytes = q->constraint_text ? strlen(q->constraint_text) : 0;
    unsigned limit = have.kind == TDM_CLIENT_CONSTRAINT_REGEX ? TDM_HTTP_MAX_REGEX_BYTES
                                                              : TDM_HTTP_MAX_CONSTRAINT_BYTES;
    if (bytes > limit)
        return tdm_error_set_field(err, TDM_EINVALID, have.param,
                                   "%s is %zu bytes; at most %u are compiled", have.param, bytes,
                                   limit);
    snprintf(q->constraint_param, sizeof q->constraint_param, "%s", have.param);
    q->creq.constraint_kind = (tdm_client_constraint_t)have.kind;
    q->creq.constraint = q->constraint_text;
    return TDM_OK;
}
