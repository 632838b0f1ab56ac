/* config_value.c - reading one value of a libyaml document as the key table's row says: the
 * type, then the bounds, with messages "FILE:LINE: key 'a.b': must be …, got …".
 *
 * Numbers and booleans must be plain scalars (a quoted "8000" is a string); null is a value
 * only where a row is optional. Nothing here follows the document's own nesting: a MAPPING
 * row reads its section's rows and no further, so aliases and deep nesting cannot make it loop.
 */
#include "config_internal.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* ---- the loader's helpers ---- */

size_t tdm_config_line(const yaml_node_t *n)
{
    return n->start_mark.line + 1;
}

int tdm_config_fail(tdm_config_loader_t *ld, const yaml_node_t *at, const char *key,
                    const char *fmt, ...)
{
    char msg[TDM_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (!key[0]) /* a problem with the top level itself */
        return tdm_error_set(ld->err, TDM_EINVALID, "%s:%zu: %s", ld->name, tdm_config_line(at),
                             msg);
    return tdm_error_set_field(ld->err, TDM_EINVALID, key, "%s:%zu: key '%s': %s", ld->name,
                               tdm_config_line(at), key, msg);
}

int tdm_config_fail_memory(tdm_config_loader_t *ld)
{
    return tdm_error_set(ld->err, TDM_ERESOURCE, "%s: out of memory", ld->name);
}

static yaml_node_t *node_at(tdm_config_loader_t *ld, int index)
{
    return yaml_document_get_node(ld->doc, index);
}

static const char *scalar_text(const yaml_node_t *n)
{
    return (const char *)n->data.scalar.value;
}

bool tdm_config_is_null(const yaml_node_t *n)
{
    if (n->type != YAML_SCALAR_NODE || n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
        return false;
    const char *s = scalar_text(n);
    return n->data.scalar.length == 0 || strcmp(s, "~") == 0 || strcmp(s, "null") == 0 ||
           strcmp(s, "Null") == 0 || strcmp(s, "NULL") == 0;
}

const char *tdm_config_describe(const yaml_node_t *n, char *buf, size_t cap)
{
    if (n->type == YAML_MAPPING_NODE)
        return "a mapping";
    if (n->type == YAML_SEQUENCE_NODE)
        return "a list";
    if (tdm_config_is_null(n))
        return "nothing (null)";
    const char *s = scalar_text(n);
    int width = n->data.scalar.length > 60 ? 60 : (int)n->data.scalar.length;
    const char *more = n->data.scalar.length > 60 ? "..." : "";
    if (n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE)
        snprintf(buf, cap, "'%.*s%s'", width, s, more);
    else
        snprintf(buf, cap, "the quoted string '%.*s%s'", width, s, more);
    return buf;
}

void tdm_config_key_join(char *out, const char *path, const char *name)
{
    int n = snprintf(out, TDM_CONFIG_KEY_MAX, "%s%s%s", path, path[0] ? "." : "", name);
    if (n < 0)
        out[0] = '\0';
}

/* The names of section's rows (removed keys left out), comma-separated, into out (cap
 * bytes): whole names only; when they do not all fit, the last ones are counted instead
 * ("…, and 4 more: `tandem config defaults` lists them"), so that a long list is never cut in
 * the middle of a name. */
static void known_list(char *out, size_t cap, tdm_config_section_t section)
{
    static const char more_fmt[] = ", and %zu more: `tandem config defaults` lists them";
    const char *known[64];
    size_t n = 0, len = 0, n_keys;
    const tdm_config_key_t *keys = tdm_config_keys(&n_keys);
    for (size_t i = 0; i < n_keys && n < TDM_CONFIG_N_OF(known); i++)
        if (keys[i].section == section && keys[i].type != TDM_CONFIG_TYPE_REMOVED)
            known[n++] = keys[i].name;
    out[0] = '\0';
    for (size_t i = 0; i < n; i++) {
        size_t need = strlen(known[i]) + (i ? 2 : 0);
        /* room for this name, and for the count of the rest unless it is the last one */
        size_t tail = i + 1 < n ? sizeof more_fmt + 8 : 0;
        if (len + need + tail >= cap) {
            snprintf(out + len, cap - len, more_fmt, n - i);
            return;
        }
        len += (size_t)snprintf(out + len, cap - len, "%s%s", i ? ", " : "", known[i]);
    }
}

/* Fails for key k of a mapping at path when it is not a row of section or repeats an earlier
 * key of the mapping (pairs before p). */
static int check_name(tdm_config_loader_t *ld, const yaml_node_t *map, const yaml_node_pair_t *p,
                      const char *path, tdm_config_section_t section)
{
    const yaml_node_t *k = node_at(ld, p->key);
    char key[TDM_CONFIG_KEY_MAX];
    tdm_config_key_join(key, path, scalar_text(k));
    if (!tdm_config_key_find(section, scalar_text(k))) {
        char list[TDM_ERRMSG_MAX];
        /* what the message has room for after "FILE:LINE: key 'KEY': unknown key (...)" */
        size_t used = strlen(ld->name) + strlen(key) + 64;
        known_list(list, used < sizeof list / 2 ? sizeof list - used : sizeof list / 2, section);
        return tdm_config_fail(ld, k, key, "unknown key (expected one of: %s)", list);
    }
    for (const yaml_node_pair_t *q = map->data.mapping.pairs.start; q < p; q++) {
        const yaml_node_t *prev = node_at(ld, q->key);
        if (strcmp(scalar_text(prev), scalar_text(k)) == 0)
            return tdm_config_fail(ld, k, key, "duplicate key (first at line %zu)",
                                   tdm_config_line(prev));
    }
    return TDM_OK;
}

/* Checks that map is a mapping (null counts as an empty one) whose keys are all plain names
 * of section's rows, none repeated. */
static int check_mapping(tdm_config_loader_t *ld, const yaml_node_t *map, const char *path,
                         tdm_config_section_t section)
{
    char got[96];
    if (tdm_config_is_null(map))
        return TDM_OK;
    if (map->type != YAML_MAPPING_NODE)
        return tdm_config_fail(ld, map, path, "must be a mapping, got %s",
                               tdm_config_describe(map, got, sizeof got));
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top;
         p++) {
        const yaml_node_t *k = node_at(ld, p->key);
        if (k->type != YAML_SCALAR_NODE)
            return tdm_config_fail(ld, k, path, "keys must be names, got %s",
                                   tdm_config_describe(k, got, sizeof got));
        int rc = check_name(ld, map, p, path, section);
        if (rc != TDM_OK)
            return rc;
    }
    return TDM_OK;
}

/* ---- scalars ---- */

/* Reads a string value into *out (freeing the old one). optional: null or "" give NULL;
 * otherwise they are an error. */
static int get_string(tdm_config_loader_t *ld, const yaml_node_t *v, const char *key, bool optional,
                      char **out)
{
    char got[96];
    if (v->type != YAML_SCALAR_NODE)
        return tdm_config_fail(ld, v, key, "must be a string, got %s",
                               tdm_config_describe(v, got, sizeof got));
    if (tdm_config_is_null(v) || v->data.scalar.length == 0) {
        if (!optional)
            return tdm_config_fail(ld, v, key, "must not be empty");
        free(*out);
        *out = NULL;
        return TDM_OK;
    }
    if (strlen(scalar_text(v)) != v->data.scalar.length)
        return tdm_config_fail(ld, v, key, "must not contain a NUL character");
    char *s = tdm_strdup(scalar_text(v));
    if (!s)
        return tdm_config_fail_memory(ld);
    free(*out);
    *out = s;
    return TDM_OK;
}

/* A plain scalar, the only kind a number or a boolean may be; fails with "must be WHAT". */
static int need_plain(tdm_config_loader_t *ld, const yaml_node_t *v, const char *key,
                      const char *what)
{
    char got[96];
    if (v->type != YAML_SCALAR_NODE || v->data.scalar.style != YAML_PLAIN_SCALAR_STYLE ||
        tdm_config_is_null(v))
        return tdm_config_fail(ld, v, key, "must be %s, got %s", what,
                               tdm_config_describe(v, got, sizeof got));
    return TDM_OK;
}

/* " UNIT" for messages, or "". */
static const char *unit_suffix(const tdm_config_key_t *k, char *buf, size_t cap)
{
    if (!k->unit)
        return "";
    snprintf(buf, cap, " %s", k->unit);
    return buf;
}

/* The plain scalar v as a decimal integer (integer: into *ix, clamped to a long long's range)
 * or a finite number (into *dx); fails "must be an integer" / "a number". */
static int get_plain_number(tdm_config_loader_t *ld, const yaml_node_t *v, const char *key,
                            bool integer, long long *ix, double *dx)
{
    char got[96];
    const char *what = integer ? "an integer" : "a number";
    int rc = need_plain(ld, v, key, what);
    if (rc != TDM_OK)
        return rc;
    const char *s = scalar_text(v);
    char *end;
    errno = 0;
    bool finite = true;
    if (integer) {
        *ix = strtoll(s, &end, 10);
    } else {
        *dx = strtod(s, &end);
        finite = isfinite(*dx);
    }
    /* an integer past what a long long holds is still an integer: *ix is clamped
     * (LLONG_MIN / LLONG_MAX), so the caller's bounds check names its range */
    bool range = errno == ERANGE && !integer;
    if (end == s || *end != '\0' || isspace((unsigned char)*s) || !finite || range)
        return tdm_config_fail(ld, v, key, "must be %s, got %s", what,
                               tdm_config_describe(v, got, sizeof got));
    return TDM_OK;
}

/* A decimal integer in the row's bounds (a power of two with TDM_CONFIG_POW2). */
static int get_int(tdm_config_loader_t *ld, const tdm_config_key_t *k, const yaml_node_t *v,
                   const char *key, int *out)
{
    char unit[32];
    long long x;
    int rc = get_plain_number(ld, v, key, true, &x, NULL);
    if (rc != TDM_OK)
        return rc;
    long long min = (long long)k->min, max = (long long)k->max;
    bool pow2 = k->flags & TDM_CONFIG_POW2;
    if (x < min || x > max || (pow2 && (x & (x - 1)) != 0))
        return tdm_config_fail(ld, v, key, "must be %sbetween %lld and %lld%s, got %s",
                               pow2 ? "a power of two " : "", min, max,
                               unit_suffix(k, unit, sizeof unit), scalar_text(v));
    *out = (int)x;
    return TDM_OK;
}

/* A finite number in the row's bounds. */
static int get_number(tdm_config_loader_t *ld, const tdm_config_key_t *k, const yaml_node_t *v,
                      const char *key, double *out)
{
    char unit[32];
    double x;
    int rc = get_plain_number(ld, v, key, false, NULL, &x);
    if (rc != TDM_OK)
        return rc;
    bool open = k->flags & TDM_CONFIG_MIN_OPEN;
    if ((open ? x <= k->min : x < k->min) || x > k->max)
        return tdm_config_fail(ld, v, key, "must be %s %g %s %g%s, got %s",
                               open ? "more than" : "from", k->min, open ? "and at most" : "to",
                               k->max, unit_suffix(k, unit, sizeof unit), scalar_text(v));
    *out = x;
    return TDM_OK;
}

/* A byte size (tdm_config_parse_bytes) in the row's bounds. */
static int get_bytes(tdm_config_loader_t *ld, const tdm_config_key_t *k, const yaml_node_t *v,
                     const char *key, uint64_t *out)
{
    char got[96], lo[24], hi[24];
    uint64_t x;
    if (v->type != YAML_SCALAR_NODE || tdm_config_parse_bytes(scalar_text(v), &x) != TDM_OK)
        return tdm_config_fail(ld, v, key,
                               "must be a byte size such as 512MiB, 2GiB or 1.5GB, below 8EiB "
                               "(2^63 bytes), got %s",
                               tdm_config_describe(v, got, sizeof got));
    uint64_t min = (uint64_t)k->min, max = (uint64_t)k->max;
    if (x >= min && x <= max) {
        *out = x;
        return TDM_OK;
    }
    tdm_config_format_bytes(min, lo, sizeof lo);
    tdm_config_format_bytes(max, hi, sizeof hi);
    if (k->max >= (double)INT64_MAX)
        return tdm_config_fail(ld, v, key, "must be at least %s, got %s (%llu bytes)", lo,
                               scalar_text(v), (unsigned long long)x);
    return tdm_config_fail(ld, v, key, "must be from %s to %s, got %s (%llu bytes)", lo, hi,
                           scalar_text(v), (unsigned long long)x);
}

static int get_bool(tdm_config_loader_t *ld, const yaml_node_t *v, const char *key, bool *out)
{
    char got[96];
    static const char *const yes[] = {"true", "yes", "on"}, *const no[] = {"false", "no", "off"};
    int rc = need_plain(ld, v, key, "true or false");
    if (rc != TDM_OK)
        return rc;
    for (size_t i = 0; i < TDM_CONFIG_N_OF(yes); i++) {
        if (strcasecmp(scalar_text(v), yes[i]) == 0) {
            *out = true;
            return TDM_OK;
        }
        if (strcasecmp(scalar_text(v), no[i]) == 0) {
            *out = false;
            return TDM_OK;
        }
    }
    return tdm_config_fail(ld, v, key, "must be true or false, got %s",
                           tdm_config_describe(v, got, sizeof got));
}

/* One of the row's enum values (by name, or by its parse function when it has aliases);
 * null on an optional row clears the "is set" bool at aux_offset. */
static int get_enum(tdm_config_loader_t *ld, const tdm_config_key_t *k, const yaml_node_t *v,
                    const char *key, char *base)
{
    const tdm_config_enum_t *e = k->values;
    bool optional = k->flags & TDM_CONFIG_OPTIONAL;
    if (optional &&
        (tdm_config_is_null(v) || (v->type == YAML_SCALAR_NODE && v->data.scalar.length == 0))) {
        *(bool *)(base + k->aux_offset) = false;
        return TDM_OK;
    }
    int x = -1;
    for (int i = 0; v->type == YAML_SCALAR_NODE && x < 0 && i < e->n_values; i++)
        if (strcmp(scalar_text(v), e->name(i)) == 0)
            x = i;
    if (x < 0 && e->parse && v->type == YAML_SCALAR_NODE)
        x = e->parse(scalar_text(v));
    if (x >= 0) {
        tdm_config_enum_store(base + k->offset, k->size, x);
        if (optional)
            *(bool *)(base + k->aux_offset) = true;
        return TDM_OK;
    }
    char got[96], list[128] = "";
    for (int i = 0; i < e->n_values; i++) {
        size_t len = strlen(list);
        snprintf(list + len, sizeof list - len, "%s%s", i ? ", " : "", e->name(i));
    }
    return tdm_config_fail(ld, v, key, "must be one of %s; got %s", list,
                           tdm_config_describe(v, got, sizeof got));
}

/* Expands a leading "~/" with $HOME in place. */
static int expand_home(tdm_config_loader_t *ld, char **path)
{
    const char *home = getenv("HOME");
    if (!*path || strncmp(*path, "~/", 2) != 0 || !home || !*home)
        return TDM_OK;
    size_t n = strlen(home) + strlen(*path);
    char *full = malloc(n);
    if (!full)
        return tdm_config_fail_memory(ld);
    snprintf(full, n, "%s%s", home, *path + 1);
    free(*path);
    *path = full;
    return TDM_OK;
}

/* Whether s passes the row's checks: an endpoint's form, then the row's refuse function;
 * fails at v naming key otherwise. */
static int check_text(tdm_config_loader_t *ld, const tdm_config_key_t *k, const yaml_node_t *v,
                      const char *key, const char *s)
{
    char got[96], why[TDM_ERRMSG_MAX / 2];
    tdm_config_describe(v, got, sizeof got);
    if (k->type == TDM_CONFIG_TYPE_ENDPOINT && !tdm_config_endpoint_valid(s))
        return tdm_config_fail(ld, v, key,
                               "must be a ZeroMQ endpoint tcp://HOST:PORT, ipc://PATH or "
                               "inproc://NAME, got %s",
                               got);
    if (k->refuse && k->refuse(s, got, why, sizeof why))
        return tdm_config_fail(ld, v, key, "%s", why);
    return TDM_OK;
}

/* A string row (STRING, PATH, ENDPOINT, CURVE_KEY) into the char * at field. */
static int get_text(tdm_config_loader_t *ld, const tdm_config_key_t *k, const yaml_node_t *v,
                    const char *key, char **field)
{
    char *s = NULL;
    int rc = get_string(ld, v, key, k->flags & TDM_CONFIG_OPTIONAL, &s);
    if (rc == TDM_OK && s)
        rc = check_text(ld, k, v, key, s);
    if (rc == TDM_OK && k->type == TDM_CONFIG_TYPE_PATH)
        rc = expand_home(ld, &s);
    if (rc != TDM_OK) {
        free(s);
        return rc;
    }
    free(*field);
    *field = s;
    return TDM_OK;
}

/* ---- lists and mappings ---- */

/* A list of strings into the char ** at base + offset and its count at base + aux_offset,
 * each item checked by the row's refuse function; a repeated item is refused. Null or []
 * leave the list empty. */
static int get_list(tdm_config_loader_t *ld, const tdm_config_key_t *k, const yaml_node_t *v,
                    const char *name, char *base)
{
    char got[96];
    char ***items = (char ***)(base + k->offset);
    size_t *n_items = (size_t *)(base + k->aux_offset);
    if (tdm_config_is_null(v))
        return TDM_OK;
    if (v->type != YAML_SEQUENCE_NODE)
        return tdm_config_fail(ld, v, name, "must be a list of strings, got %s",
                               tdm_config_describe(v, got, sizeof got));
    size_t n = (size_t)(v->data.sequence.items.top - v->data.sequence.items.start);
    if (n == 0)
        return TDM_OK;
    if (!(*items = calloc(n, sizeof **items)))
        return tdm_config_fail_memory(ld);
    for (size_t i = 0; i < n; i++) {
        const yaml_node_t *item = node_at(ld, v->data.sequence.items.start[i]);
        char key[TDM_CONFIG_KEY_MAX];
        snprintf(key, sizeof key, "%s[%zu]", name, i);
        int rc = get_string(ld, item, key, false, &(*items)[*n_items]);
        if (rc != TDM_OK)
            return rc;
        (*n_items)++;
        if ((rc = check_text(ld, k, item, key, (*items)[i])) != TDM_OK)
            return rc;
        for (size_t j = 0; j < i; j++)
            if (strcmp((*items)[j], (*items)[i]) == 0)
                return tdm_config_fail(ld, item, key, "duplicate %s (same as %s[%zu])", k->item,
                                       name, j);
    }
    return TDM_OK;
}

const yaml_node_t *tdm_config_mark(const yaml_node_t *const *marks, tdm_config_section_t section,
                                   const char *name)
{
    const tdm_config_key_t *k = tdm_config_key_find(section, name);
    return marks && k ? marks[tdm_config_key_index(k)] : NULL;
}

int tdm_config_read_section(tdm_config_loader_t *ld, const yaml_node_t *map, const char *path,
                            tdm_config_section_t section, void *base, const yaml_node_t **marks)
{
    int rc = check_mapping(ld, map, path, section);
    if (rc != TDM_OK || map->type != YAML_MAPPING_NODE)
        return rc;
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top;
         p++) {
        const char *name = scalar_text(node_at(ld, p->key));
        const tdm_config_key_t *k = tdm_config_key_find(section, name);
        const yaml_node_t *v = node_at(ld, p->value);
        char key[TDM_CONFIG_KEY_MAX];
        tdm_config_key_join(key, path, name);
        if (marks)
            marks[tdm_config_key_index(k)] = v;
        if ((rc = tdm_config_read_value(ld, k, v, key, base)) != TDM_OK)
            return rc;
    }
    return TDM_OK;
}

int tdm_config_read_value(tdm_config_loader_t *ld, const tdm_config_key_t *k, const yaml_node_t *v,
                          const char *key, void *base_)
{
    char *base = base_, got[96];
    void *field = base + k->offset;
    switch (k->type) {
    case TDM_CONFIG_TYPE_BOOL: return get_bool(ld, v, key, field);
    case TDM_CONFIG_TYPE_INT: return get_int(ld, k, v, key, field);
    case TDM_CONFIG_TYPE_NUMBER: return get_number(ld, k, v, key, field);
    case TDM_CONFIG_TYPE_BYTES: return get_bytes(ld, k, v, key, field);
    case TDM_CONFIG_TYPE_ENUM: return get_enum(ld, k, v, key, (char *)base);
    case TDM_CONFIG_TYPE_LIST: return get_list(ld, k, v, key, (char *)base);
    case TDM_CONFIG_TYPE_DEVICE:
        if (v->type != YAML_SCALAR_NODE || tdm_config_device_parse(scalar_text(v), field) != TDM_OK)
            return tdm_config_fail(ld, v, key, "must be cpu or cuda:N (N from 0 to %d), got %s",
                                   TDM_CONFIG_MAX_CUDA_DEVICES - 1,
                                   tdm_config_describe(v, got, sizeof got));
        return TDM_OK;
    case TDM_CONFIG_TYPE_MAPPING:
        return tdm_config_read_section(ld, v, key, k->sub, base,
                                       tdm_config_section_is_node(k->sub) ? NULL : ld->marks);
    case TDM_CONFIG_TYPE_REMOVED: return tdm_config_fail(ld, v, key, "was removed: %s", k->doc);
    case TDM_CONFIG_TYPE_NODES: return tdm_config_read_nodes(ld, v, (tdm_config_t *)base);
    case TDM_CONFIG_TYPE_MODELS: return tdm_config_read_models(ld, v, (tdm_config_t *)base);
    default: return get_text(ld, k, v, key, field);
    }
}
