/* json_schema_depend.c - dependentRequired, dependentSchemas (2019-09 and later) and draft 4-7
 * `dependencies`, compiled exactly by expansion into alternatives.
 *
 * For each trigger property (a name whose presence requires others) that is not already
 * required, one alternative has it present (it and its dependents required) and one has it
 * absent (its schema `false`, so it never appears; a name not defined becomes a defined one
 * with the schema `false`, which also keeps it out of the additional properties). A trigger
 * that can never appear (not defined, additionalProperties false) requires nothing. Cases that
 * require a trigger they leave absent are dropped. More than JS_DEPEND_MAX such triggers is refused
 * (2^n alternatives). dependentSchemas and `dependencies` with a schema value likewise: a present
 * trigger's case is also merged with its schema (a required trigger's schema with every case);
 * cases the merge leaves no value are dropped.
 */
#include <stdio.h>
#include <string.h>

#include "json_schema_internal.h"

#define JS_DEPEND_MAX 4 /* triggers not already required: 2^4 = 16 alternatives at most */

static bool array_has(json_t *a, const char *name)
{
    size_t i;
    json_t *v;
    json_array_foreach(a, i, v)
    {
        if (json_is_string(v) && strcmp(json_string_value(v), name) == 0)
            return true;
    }
    return false;
}

static bool defined(json_t *s, const char *name)
{
    json_t *props = json_object_get(s, "properties");
    return json_is_object(props) && json_object_get(props, name);
}

/* Appends the names of deps (an array of strings) not yet in req. Returns 0 or -1 (OOM). */
static int require_all(json_t *req, json_t *deps)
{
    size_t i;
    json_t *v;
    json_array_foreach(deps, i, v)
    {
        if (!array_has(req, json_string_value(v)) && json_array_append(req, v) != 0)
            return -1;
    }
    return 0;
}

/* Checks the keyword key of s (an object of name -> array of strings) and collects the
 * triggers not already required into trig[*n] (with their dependents in deps[]); the
 * triggers already required get their dependents added to req. */
/* The index of trigger name in trig[n], or n. */
static int find_trigger(const char **trig, int n, const char *name)
{
    int i = 0;
    while (i < n && strcmp(trig[i], name) != 0)
        i++;
    return i;
}

static int collect(js_ctx_t *c, json_t *s, const char *ptr, const char *key, json_t *req,
                   const char **trig, json_t **deps, json_t **schemas, json_t *always, int *n)
{
    json_t *d = json_object_get(s, key), *ap = json_object_get(s, "additionalProperties"), *v, *e;
    bool pp = json_object_get(s, "patternProperties") != NULL;
    const char *name;
    if (!d)
        return 0;
    if (!json_is_object(d))
        return js_fail(c, ptr, key, "must be an object");
    json_object_foreach(d, name, v)
    {
        size_t i;
        bool schema = !json_is_array(v);
        if (schema && strcmp(key, "dependentRequired") == 0)
            return js_fail(c, ptr, key, "'%s' must have an array of property names", name);
        if (!schema && strcmp(key, "dependentSchemas") == 0)
            return js_fail(c, ptr, key, "'%s' must have a schema", name);
        json_array_foreach(v, i, e)
        {
            if (!json_is_string(e))
                return js_fail(c, ptr, key, "'%s' must have an array of property names", name);
        }
        bool empty = schema ? json_is_true(v) || (json_is_object(v) && json_object_size(v) == 0)
                            : json_array_size(v) == 0;
        if (empty || (!defined(s, name) && json_is_false(ap) && !pp))
            continue; /* nothing required, or the trigger can never appear */
        if (array_has(req, name)) {
            if (schema ? json_array_append(always, v) != 0 : require_all(req, v) != 0)
                return js_oom(c);
            continue;
        }
        int k = find_trigger(trig, *n, name);
        if (k == *n && *n >= JS_DEPEND_MAX)
            return js_fail(c, ptr, key,
                           "'%s': more than %d properties not required have dependents (not "
                           "supported)",
                           name, JS_DEPEND_MAX);
        if (k == *n) {
            trig[k] = name;
            deps[k] = schemas[k] = NULL;
            (*n)++;
        }
        if (schema && schemas[k])
            return js_fail(c, ptr, key, "'%s': two dependent schemas (not supported)", name);
        if (schema)
            schemas[k] = v;
        else if (deps[k] && require_all(deps[k], v) != 0)
            return js_oom(c);
        else if (!deps[k] && (!(deps[k] = json_copy(v)) || json_array_append_new(c->keep, deps[k])))
            return js_oom(c); /* c->keep owns the copy */
    }
    return 0;
}

/* Whether the case mask (the triggers present) requires a trigger it has absent. */
static bool contradicts(json_t *req, const char **trig, json_t **deps, int n, unsigned mask)
{
    for (int i = 0; i < n; i++) {
        if (mask & (1u << i))
            continue;
        if (array_has(req, trig[i]))
            return true;
        for (int j = 0; j < n; j++)
            if ((mask & (1u << j)) && array_has(deps[j], trig[i]))
                return true;
    }
    return false;
}

/* The alternative where the triggers in mask are present and the others absent (owned by
 * c->keep), or NULL on out of memory. */
static json_t *variant(js_ctx_t *c, json_t *s, json_t *req, const char **trig, json_t **deps, int n,
                       unsigned mask)
{
    json_t *t = json_copy(s);
    if (!t || json_array_append_new(c->keep, t) != 0) /* keep owns t (or freed it) */
        return NULL;
    json_t *p0 = json_object_get(t, "properties");
    json_t *r = json_copy(req), *props = json_is_object(p0) ? json_copy(p0) : json_object();
    bool ok = r && props;
    for (int i = 0; ok && i < n; i++) {
        if (mask & (1u << i))
            ok =
                json_array_append_new(r, json_string(trig[i])) == 0 && require_all(r, deps[i]) == 0;
        else
            ok = json_object_set_new(props, trig[i], json_false()) == 0;
    }
    ok = ok && json_object_set(t, "required", r) == 0 &&
         json_object_set(t, "properties", props) == 0 && js_merge_alias(c, props, p0) == 0;
    json_decref(r);
    json_decref(props);
    json_object_del(t, "dependentRequired");
    json_object_del(t, "dependencies");
    json_object_del(t, "dependentSchemas");
    return ok ? t : NULL;
}

/* t merged with the schemas of the present triggers and those of the required ones (always):
 * *out, or NULL when the merge allows no value (the case is dropped). */
static int with_schemas(js_ctx_t *c, json_t *t, json_t **schemas, int n, unsigned mask,
                        json_t *always, const char *ptr, json_t **out)
{
    size_t i;
    json_t *v;
    int rc = 0;
    *out = t;
    for (int k = 0; k < n && rc == 0; k++)
        if ((mask & (1u << k)) && schemas[k])
            rc = js_merge(c, *out, schemas[k], ptr, out);
    json_array_foreach(always, i, v)
    {
        if (rc == 0)
            rc = js_merge(c, *out, v, ptr, out);
    }
    if (rc == TDM_EINVALID && c->unsat) {
        tdm_error_clear(c->err);
        c->unsat = false;
        *out = NULL;
        return 0;
    }
    return rc;
}

int js_expand_dependent(js_ctx_t *c, json_t *s, const char *ptr, json_t **out)
{
    *out = NULL;
    if (!json_object_get(s, "dependentRequired") && !json_object_get(s, "dependencies") &&
        !json_object_get(s, "dependentSchemas"))
        return 0;
    json_t *req0 = json_object_get(s, "required");
    json_t *req = json_is_array(req0) ? json_copy(req0) : json_array(), *always = json_array();
    const char *trig[JS_DEPEND_MAX];
    json_t *deps[JS_DEPEND_MAX], *schemas[JS_DEPEND_MAX];
    int n = 0, rc = req && always ? 0 : js_oom(c);
    static const char *const keys[] = {"dependentRequired", "dependencies", "dependentSchemas"};
    for (int k = 0; k < 3 && rc == 0; k++)
        rc = collect(c, s, ptr, keys[k], req, trig, deps, schemas, always, &n);
    json_t *alts = rc == 0 ? json_array() : NULL;
    if (rc == 0 && (!alts || json_array_append(c->keep, alts) != 0))
        rc = js_oom(c);
    for (unsigned m = 0; rc == 0 && m < (1u << n); m++) {
        if (contradicts(req, trig, deps, n, m))
            continue;
        json_t *v = variant(c, s, req, trig, deps, n, m);
        if (!v)
            rc = js_oom(c);
        rc = rc ? rc : with_schemas(c, v, schemas, n, m, always, ptr, &v);
        if (rc == 0 && v && json_array_append(alts, v) != 0)
            rc = js_oom(c);
    }
    if (rc == 0 && json_array_size(alts) == 0)
        rc = js_fail_unsat(c, ptr, NULL, "no value allowed (dependent schemas)");
    if (rc == 0)
        *out = alts;
    json_decref(alts);
    json_decref(req);
    json_decref(always);
    return rc;
}
