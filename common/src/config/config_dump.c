/* config_dump.c - writing a config out from the key table: the resolved config as YAML that
 * loads back to the same values (tdm_config_dump), and the docs' Markdown tables of the keys
 * (tdm_config_keys_markdown, which docs/operations.md holds verbatim). */
#include "config_internal.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- the resolved config ---- */

/* Writes s as a YAML double-quoted scalar, or null. */
static void put_string(FILE *out, const char *s)
{
    if (!s) {
        fputs("null", out);
        return;
    }
    fputc('"', out);
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"' || *c == '\\')
            fprintf(out, "\\%c", *c);
        else if (*c < 0x20 || *c == 0x7f)
            fprintf(out, "\\x%02x", *c);
        else
            fputc(*c, out);
    }
    fputc('"', out);
}

/* Writes the shortest decimal form of x that reads back as the same double. */
static void put_double(FILE *out, double x)
{
    char buf[32];
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, x);
        if (strtod(buf, NULL) == x)
            break;
    }
    fputs(buf, out);
}

static void dump_section(tdm_config_section_t section, const char *base, int indent,
                         bool first_dash, FILE *out);

/* Whether row k of the struct at base is left out of the dump. */
static bool dump_skips(const tdm_config_key_t *k, const char *base)
{
    const void *field = base + k->offset;
    if (k->type == TDM_CONFIG_TYPE_REMOVED || k->type == TDM_CONFIG_TYPE_NODES ||
        k->type == TDM_CONFIG_TYPE_MODELS)
        return true;
    /* several models are dumped as the models: list (tdm_config_dump), not as model: */
    if (k->section == TDM_CONFIG_SECTION_TOP && k->type == TDM_CONFIG_TYPE_MAPPING &&
        k->sub == TDM_CONFIG_SECTION_MODEL &&
        ((const tdm_config_t *)(const void *)base)->n_models > 1)
        return true;
    if ((k->flags & TDM_CONFIG_DECODE_ONLY) &&
        ((const tdm_node_config_t *)(const void *)base)->role != TDM_NODE_ROLE_DECODE)
        return true;
    if (!(k->flags & TDM_CONFIG_DUMP_NONZERO))
        return false;
    return k->type == TDM_CONFIG_TYPE_BYTES ? *(const uint64_t *)field == 0
                                            : *(const double *)field == 0.0;
}

/* The value of row k of the struct at base, after "name:" (a list or mapping on the lines
 * below, indented by indent + 2). */
static void dump_value(const tdm_config_key_t *k, const char *base, int indent, FILE *out)
{
    const void *field = base + k->offset;
    char buf[32];
    switch (k->type) {
    case TDM_CONFIG_TYPE_BOOL: fputs(*(const bool *)field ? " true" : " false", out); break;
    case TDM_CONFIG_TYPE_INT: fprintf(out, " %d", *(const int *)field); break;
    case TDM_CONFIG_TYPE_NUMBER:
        fputc(' ', out);
        put_double(out, *(const double *)field);
        break;
    case TDM_CONFIG_TYPE_BYTES:
        tdm_config_format_bytes(*(const uint64_t *)field, buf, sizeof buf);
        fprintf(out, " %s", buf);
        break;
    case TDM_CONFIG_TYPE_ENUM:
        if ((k->flags & TDM_CONFIG_OPTIONAL) && !*(const bool *)(base + k->aux_offset))
            fputs(" null", out);
        else
            fprintf(out, " %s", k->values->name(tdm_config_enum_load(field, k->size)));
        break;
    case TDM_CONFIG_TYPE_DEVICE:
        tdm_config_device_format(*(const tdm_node_device_t *)field, buf, sizeof buf);
        fprintf(out, " %s", buf);
        break;
    case TDM_CONFIG_TYPE_LIST: {
        char *const *items = *(char *const *const *)field;
        size_t n = *(const size_t *)(base + k->aux_offset);
        fputs(n ? "" : " []", out);
        for (size_t i = 0; i < n; i++) {
            fprintf(out, "\n%*s- ", indent + 2, "");
            put_string(out, items[i]);
        }
        break;
    }
    case TDM_CONFIG_TYPE_MAPPING:
        fputc('\n', out);
        dump_section(k->sub, base, indent + 2, false, out);
        return; /* dump_section ended its last line */
    default:    /* the strings */
        fputc(' ', out);
        put_string(out, *(char *const *)field);
        break;
    }
    fputc('\n', out);
}

/* The rows of section in the struct at base, one "name: value" each, indented by indent; with
 * first_dash the first one starts a list item ("- " in the last two columns of the indent). */
static void dump_section(tdm_config_section_t section, const char *base, int indent,
                         bool first_dash, FILE *out)
{
    size_t n_keys;
    const tdm_config_key_t *keys = tdm_config_keys(&n_keys);
    for (size_t i = 0; i < n_keys; i++) {
        const tdm_config_key_t *k = &keys[i];
        if (k->section != section || dump_skips(k, base))
            continue;
        if (first_dash)
            fprintf(out, "%*s- %s:", indent - 2, "", k->name);
        else
            fprintf(out, "%*s%s:", indent, "", k->name);
        first_dash = false;
        dump_value(k, base, indent, out);
    }
}

int tdm_config_dump(const tdm_config_t *cfg, FILE *out)
{
    fprintf(out, "# Tandem cluster configuration, resolved (defaults included).\n");
    dump_section(TDM_CONFIG_SECTION_TOP, (const char *)cfg, 0, false, out);
    if (cfg->n_models > 1) {
        /* each entry's rows are fields of a tdm_config_t's model: dumped from a shallow copy */
        fprintf(out, "models:\n");
        for (size_t i = 0; i < cfg->n_models; i++) {
            tdm_config_t one;
            memset(&one, 0, sizeof one);
            one.model = cfg->models[i];
            dump_section(TDM_CONFIG_SECTION_MODEL, (const char *)&one, 4, true, out);
        }
    }
    fprintf(out, "nodes:\n");
    for (size_t i = 0; i < cfg->n_nodes; i++)
        dump_section(TDM_CONFIG_SECTION_NODE, (const char *)&cfg->nodes[i], 4, true, out);
    if (fflush(out) != 0 || ferror(out))
        return TDM_EUNAVAILABLE;
    return TDM_OK;
}

/* ---- the docs' tables ---- */

/* x with thousands separators when it is a whole number ("86,400"), else as %g. */
static const char *number_text(double x, char *buf, size_t cap)
{
    if (x != floor(x) || fabs(x) >= 1e15) {
        snprintf(buf, cap, "%g", x);
        return buf;
    }
    char digits[24];
    int n = snprintf(digits, sizeof digits, "%lld", (long long)fabs(x));
    size_t len = x < 0 ? 1 : 0;
    buf[0] = '-';
    for (int i = 0; i < n && len + 2 < cap; i++) {
        if (i > 0 && (n - i) % 3 == 0)
            buf[len++] = ',';
        buf[len++] = digits[i];
    }
    buf[len] = '\0';
    return buf;
}

/* The type column of row k. */
static void md_type(const tdm_config_key_t *k, FILE *out)
{
    static const char *const names[] = {
        [TDM_CONFIG_TYPE_BOOL] = "bool",
        [TDM_CONFIG_TYPE_INT] = "int",
        [TDM_CONFIG_TYPE_NUMBER] = "number",
        [TDM_CONFIG_TYPE_BYTES] = "bytes",
        [TDM_CONFIG_TYPE_STRING] = "string",
        [TDM_CONFIG_TYPE_PATH] = "path",
        [TDM_CONFIG_TYPE_ENDPOINT] = "endpoint",
        [TDM_CONFIG_TYPE_CURVE_KEY] = "string (Z85, 40 chars)",
        [TDM_CONFIG_TYPE_DEVICE] = "`cpu` \\| `cuda:N`",
        [TDM_CONFIG_TYPE_LIST] = "list of strings",
        [TDM_CONFIG_TYPE_MAPPING] = "mapping",
    };
    if (k->type != TDM_CONFIG_TYPE_ENUM) {
        fputs(names[k->type], out);
        return;
    }
    for (int i = 0; i < k->values->n_values; i++)
        fprintf(out, "%s`%s`", i ? " \\| " : "", k->values->name(i));
    if (k->flags & TDM_CONFIG_OPTIONAL)
        fputs(" \\| `null`", out);
    if (k->values->aliases_doc)
        fprintf(out, " %s", k->values->aliases_doc);
}

/* The default of row k as the YAML value ("8", "true", "64MiB", "null"), for a row whose
 * default is one (not required, derived or a mapping); may write into buf. */
static const char *default_text(const tdm_config_key_t *k, char *buf, size_t cap)
{
    switch (k->type) {
    case TDM_CONFIG_TYPE_BOOL: return k->def != 0 ? "true" : "false";
    case TDM_CONFIG_TYPE_INT:
    case TDM_CONFIG_TYPE_NUMBER: snprintf(buf, cap, "%g", k->def); return buf;
    case TDM_CONFIG_TYPE_BYTES: tdm_config_format_bytes((uint64_t)k->def, buf, cap); return buf;
    case TDM_CONFIG_TYPE_ENUM:
        return k->flags & TDM_CONFIG_OPTIONAL ? "null" : k->values->name((int)k->def);
    case TDM_CONFIG_TYPE_DEVICE: return "cpu";
    case TDM_CONFIG_TYPE_LIST: return "[]";
    default: return k->def_text ? k->def_text : "null";
    }
}

/* The default column of row k; a mapping's is its keys' defaults in flow style
 * ("`{max_draft: 8, row_cost: 0}`"). */
static void md_default(const tdm_config_key_t *k, FILE *out)
{
    char buf[32];
    if (k->flags & (TDM_CONFIG_REQUIRED | TDM_CONFIG_DERIVED)) {
        fputs(k->flags & TDM_CONFIG_REQUIRED ? "required" : k->def_text, out);
        return;
    }
    if (k->type != TDM_CONFIG_TYPE_MAPPING) {
        fprintf(out, "`%s`", default_text(k, buf, sizeof buf));
        return;
    }
    size_t n_keys;
    const tdm_config_key_t *keys = tdm_config_keys(&n_keys);
    const char *sep = "`{";
    for (size_t i = 0; i < n_keys; i++) {
        if (keys[i].section != k->sub)
            continue;
        fprintf(out, "%s%s: %s", sep, keys[i].name, default_text(&keys[i], buf, sizeof buf));
        sep = ", ";
    }
    fputs("}`", out);
}

/* The range part of the meaning column of row k ("1–65,535", "more than 0, at most 1"); ""
 * for a row without bounds. */
static void md_range(const tdm_config_key_t *k, char *out, size_t cap)
{
    char lo[32], hi[32];
    out[0] = '\0';
    if (k->type == TDM_CONFIG_TYPE_BYTES) {
        tdm_config_format_bytes((uint64_t)k->min, lo, sizeof lo);
        tdm_config_format_bytes((uint64_t)k->max, hi, sizeof hi);
        if (k->max >= (double)INT64_MAX)
            snprintf(out, cap, "at least `%s`", lo);
        else
            snprintf(out, cap, "`%s`–`%s`", lo, hi);
        return;
    }
    if (k->type != TDM_CONFIG_TYPE_INT && k->type != TDM_CONFIG_TYPE_NUMBER)
        return;
    number_text(k->min, lo, sizeof lo);
    number_text(k->max, hi, sizeof hi);
    snprintf(out, cap, "%s%s%s%s%s%s%s", k->flags & TDM_CONFIG_POW2 ? "a power of two, " : "",
             k->flags & TDM_CONFIG_MIN_OPEN ? "more than " : "", lo,
             k->flags & TDM_CONFIG_MIN_OPEN ? ", at most " : "–", hi, k->unit ? " " : "",
             k->unit ? k->unit : "");
}

/* One table row: row k, its key shown as prefix + name. The meaning column is "decode nodes
 * only", the range and the doc line, in that order, each of them there is. */
static void md_row(const tdm_config_key_t *k, const char *prefix, FILE *out)
{
    char range[128];
    fprintf(out, "| `%s%s` | ", prefix, k->name);
    md_type(k, out);
    fputs(" | ", out);
    md_default(k, out);
    fputs(" | ", out);
    md_range(k, range, sizeof range);
    if (k->flags & TDM_CONFIG_DECODE_ONLY)
        fprintf(out, "decode nodes only (an error on a prefill node)%s", range[0] ? "; " : ": ");
    if (range[0])
        fprintf(out, "%s: ", range);
    fprintf(out, "%s |\n", k->doc);
}

/* The table of section's rows, a nested section's rows after its own as "name.key". */
static void md_table(tdm_config_section_t section, FILE *out)
{
    size_t n_keys;
    const tdm_config_key_t *keys = tdm_config_keys(&n_keys);
    fputs("| key | type | default | range / meaning |\n| --- | --- | --- | --- |\n", out);
    for (size_t i = 0; i < n_keys; i++) {
        const tdm_config_key_t *k = &keys[i];
        if (k->section != section || k->type == TDM_CONFIG_TYPE_REMOVED)
            continue;
        md_row(k, "", out);
        if (k->type != TDM_CONFIG_TYPE_MAPPING)
            continue;
        char prefix[TDM_CONFIG_KEY_MAX];
        snprintf(prefix, sizeof prefix, "%s.", k->name);
        for (size_t j = 0; j < n_keys; j++)
            if (keys[j].section == k->sub)
                md_row(&keys[j], prefix, out);
    }
}

int tdm_config_keys_markdown(const char *section, FILE *out)
{
    size_t n_keys;
    const tdm_config_key_t *keys = tdm_config_keys(&n_keys);
    bool found = false;
    for (size_t i = 0; i < n_keys && keys[i].section == TDM_CONFIG_SECTION_TOP; i++) {
        const tdm_config_key_t *k = &keys[i];
        if (k->type == TDM_CONFIG_TYPE_MODELS) /* entries of the model table */
            continue;
        if (section && strcmp(section, k->name) != 0)
            continue;
        tdm_config_section_t sub =
            k->type == TDM_CONFIG_TYPE_NODES ? TDM_CONFIG_SECTION_NODE : k->sub;
        if (!section)
            fprintf(out, "%s<!-- tandem config keys %s -->\n", found ? "\n" : "", k->name);
        md_table(sub, out);
        found = true;
    }
    if (!found)
        return TDM_ENOTFOUND;
    if (fflush(out) != 0 || ferror(out))
        return TDM_EUNAVAILABLE;
    return TDM_OK;
}
