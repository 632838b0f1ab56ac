/* json_schema_depend.c - dependentRequired (2019-09 and later) and draft 4-7 `dependencies`
 * with array values, compiled exactly by expansion into alternatives.
 *
 * For each trigger property (a name whose presence requires others) that is not already
 * required, one alternative has it present (it and its dependents required) and one has it
 * absent (its schema `false`, so it never appears; a name not defined becomes a defined one
 * with the schema `false`, which also keeps it out of the additional properties). A trigger
 * that can never appear (not defined, additionalProperties false) requires nothing. Cases that
 * require a trigger they leave absent are dropped. More than JS_DEPEND_MAX such triggers is refused
 * (2^n alternatives). `dependencies` with a schema value (dependentSchemas) is refused.
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
static int collect(js_ctx_t *c, json_t *s, const char *ptr, const char *key, json_t *req,
                   const char **trig, json_t **deps, int *n)
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
        if (!json_is_array(v))
            return js_fail(c, ptr, key, "'%s' has a schema (not supported)", name);
        json_array_foreach(v, i, e)
        {
            if (!json_is_string(e))
                return js_fail(c, ptr, key, "'%s' must have an array of property names", name);
        }
        if (json_array_size(v) == 0 || (!defined(s, name) && json_is_false(ap) && !pp))
            continue; /* nothing required, or the trigger can never appear */
        if (array_has(req, name)) {
            if (require_all(req, v) != 0)
                return js_oom(c);
            continue;
        }
        if (*n >= JS_DEPEND_MAX)
            return js_fail(c, ptr, key,
                           "'%s': more than %d properties not required have dependents (not "
                           "supported)",
                           name, JS_DEPEND_MAX);
        trig[*n] = name;
        deps[(*n)++] = v;
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
         json_object_set(t, "properties", props) == 0;
    json_decref(r);
    json_decref(props);
    json_object_del(t, "dependentRequired");
    json_object_del(t, "dependencies");
    return ok ? t : NULL;
}

int js_expand_dependent(js_ctx_t *c, json_t *s, const char *ptr, json_t **out)
{
    *out = NULL;
    if (!json_object_get(s, "dependentRequired") && !json_object_get(s, "dependencies"))
        return 0;
    json_t *req0 = json_object_get(s, "required");
    json_t *req = json_is_array(req0) ? json_copy(req0) : json_array();
    const char *trig[JS_DEPEND_MAX];
    json_t *deps[JS_DEPEND_MAX];
    int n = 0, rc = req ? 0 : js_oom(c);
    if (rc == 0)
        rc = collect(c, s, ptr, "dependentRequired", req, trig, deps, &n);
    if (rc == 0)
        rc = collect(c, s, ptr, "dependencies", req, trig, deps, &n);
    json_t *alts = rc == 0 ? json_array() : NULL;
    if (rc == 0 && (!alts || json_array_append(c->keep, alts) != 0))
        rc = js_oom(c);
    for (unsigned m = 0; rc == 0 && m < (1u << n); m++) {
        if (contradicts(req, trig, deps, n, m))
            continue;
        json_t *v = variant(c, s, req, trig, deps, n, m);
        if (!v || json_array_append(alts, v) != 0)
            rc = js_oom(c);
    }
    if (rc == 0)
        *out = alts;
    json_decref(alts);
    json_decref(req);
    return rc;
}
