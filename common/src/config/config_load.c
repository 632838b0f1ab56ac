/* config_load.c - the strict YAML loader: a file over the defaults, then the derived defaults,
 * then the checks across keys.
 *
 * The file is read with libyaml's document API (yaml_parser_load), which keeps each node's
 * start mark, so every error names the file, the line and the dotted key. The walk follows
 * the key table's sections (top level -> section -> value, nodes -> entry -> value), never the
 * document's own nesting, so aliases and deep nesting cannot make it loop or recurse.
 */
#include "config_internal.h"

#include <stdlib.h>
#include <string.h>

/* One entry of nodes: (index i) over the node defaults, then its own checks and a distinct
 * id. */
static int read_node(tdm_config_loader_t *ld, const yaml_node_t *item, size_t i, tdm_config_t *cfg)
{
    char path[TDM_CONFIG_KEY_MAX], got[96];
    tdm_node_config_t *node = &cfg->nodes[i];
    const yaml_node_t **marks = ld->node_marks + i * ld->n_keys;
    cfg->n_nodes = i + 1;
    if (tdm_config_node_defaults(node) != TDM_OK)
        return tdm_config_fail_memory(ld);
    snprintf(path, sizeof path, "nodes[%zu]", i);
    if (tdm_config_is_null(item) || item->type != YAML_MAPPING_NODE)
        return tdm_config_fail(ld, item, path,
                               "must be a mapping with at least id and role, got %s",
                               tdm_config_describe(item, got, sizeof got));
    int rc = tdm_config_read_section(ld, item, path, TDM_CONFIG_SECTION_NODE, node, marks);
    if (rc == TDM_OK)
        rc = tdm_config_check_node(ld, item, i, node);
    if (rc != TDM_OK)
        return rc;
    for (size_t j = 0; j < i; j++) {
        if (strcmp(cfg->nodes[j].id, node->id) == 0) {
            char key[TDM_CONFIG_KEY_MAX];
            const yaml_node_t *first =
                tdm_config_mark(ld->node_marks + j * ld->n_keys, TDM_CONFIG_SECTION_NODE, "id");
            snprintf(key, sizeof key, "nodes[%zu].id", i);
            return tdm_config_fail(ld, tdm_config_mark(marks, TDM_CONFIG_SECTION_NODE, "id"), key,
                                   "duplicate node id '%s' (first at line %zu, nodes[%zu])",
                                   node->id, tdm_config_line(first), j);
        }
    }
    return TDM_OK;
}

/* The length of the list under key (a YAML sequence of 1..max entries) into *n; else the
 * failure naming key ("must be a list of PLURAL", "must list at least one LEAST", "lists N
 * PLURAL; at most MAX ..."). */
static int list_length(tdm_config_loader_t *ld, const yaml_node_t *seq, const char *key,
                       const char *plural, const char *least, size_t max, size_t *n)
{
    char got[96];
    if (seq->type != YAML_SEQUENCE_NODE)
        return tdm_config_fail(ld, seq, key, "must be a list of %s, got %s", plural,
                               tdm_config_describe(seq, got, sizeof got));
    *n = (size_t)(seq->data.sequence.items.top - seq->data.sequence.items.start);
    if (*n == 0)
        return tdm_config_fail(ld, seq, key, "must list at least one %s", least);
    if (*n > max)
        return tdm_config_fail(ld, seq, key, "lists %zu %s; at most %zu are supported", *n, plural,
                               max);
    return TDM_OK;
}

int tdm_config_read_nodes(tdm_config_loader_t *ld, const yaml_node_t *seq, tdm_config_t *cfg)
{
    size_t n;
    int rc0 = list_length(ld, seq, "nodes", "nodes", "decode node", TDM_CONFIG_MAX_NODES, &n);
    if (rc0 != TDM_OK)
        return rc0;
    cfg->nodes = calloc(n, sizeof *cfg->nodes);
    ld->node_marks = calloc(n * ld->n_keys, sizeof *ld->node_marks);
    if (!cfg->nodes || !ld->node_marks)
        return tdm_config_fail_memory(ld);
    bool have_decode = false;
    for (size_t i = 0; i < n; i++) {
        int rc = read_node(ld, yaml_document_get_node(ld->doc, seq->data.sequence.items.start[i]),
                           i, cfg);
        if (rc != TDM_OK)
            return rc;
        have_decode = have_decode || cfg->nodes[i].role == TDM_NODE_ROLE_DECODE;
    }
    if (!have_decode)
        return tdm_config_fail(ld, seq, "nodes",
                               "must list at least one decode node (role: decode)");
    return TDM_OK;
}

int tdm_config_read_models(tdm_config_loader_t *ld, const yaml_node_t *seq, tdm_config_t *cfg)
{
    char got[96], path[TDM_CONFIG_KEY_MAX];
    size_t n;
    int rc0 = list_length(ld, seq, "models", "models", "model", TDM_CONFIG_MAX_MODELS, &n);
    if (rc0 != TDM_OK)
        return rc0;
    cfg->models = calloc(n, sizeof *cfg->models);
    ld->model_marks = calloc(n * ld->n_keys, sizeof *ld->model_marks);
    if (!cfg->models || !ld->model_marks)
        return tdm_config_fail_memory(ld);
    for (size_t i = 0; i < n; i++) {
        const yaml_node_t *item =
            yaml_document_get_node(ld->doc, seq->data.sequence.items.start[i]);
        /* the model rows are fields of a tdm_config_t's model: read into a scratch one */
        tdm_config_t one;
        memset(&one, 0, sizeof one);
        int rc = tdm_config_section_defaults(TDM_CONFIG_SECTION_MODEL, &one);
        cfg->models[i] = one.model;
        cfg->n_models = i + 1;
        if (rc != TDM_OK)
            return tdm_config_fail_memory(ld);
        snprintf(path, sizeof path, "models[%zu]", i);
        if (tdm_config_is_null(item) || item->type != YAML_MAPPING_NODE)
            return tdm_config_fail(ld, item, path, "must be a mapping with at least path, got %s",
                                   tdm_config_describe(item, got, sizeof got));
        rc = tdm_config_read_section(ld, item, path, TDM_CONFIG_SECTION_MODEL, &one,
                                     ld->model_marks + i * ld->n_keys);
        cfg->models[i] = one.model;
        if (rc != TDM_OK)
            return rc;
        if (!tdm_config_mark(ld->model_marks + i * ld->n_keys, TDM_CONFIG_SECTION_MODEL, "path")) {
            char key[TDM_CONFIG_KEY_MAX];
            snprintf(key, sizeof key, "models[%zu].path", i);
            return tdm_config_fail(ld, item, key, "is required (the GGUF file this model serves)");
        }
    }
    return TDM_OK;
}

/* The whole document (NULL or null: none): the sections over the defaults, the derived
 * defaults, the checks across keys. */
static int read_root(tdm_config_loader_t *ld, const yaml_node_t *root, tdm_config_t *cfg)
{
    char got[96];
    bool empty = !root || tdm_config_is_null(root);
    if (!empty && root->type != YAML_MAPPING_NODE)
        return tdm_error_set(ld->err, TDM_EINVALID,
                             "%s:%zu: the top level must be a mapping, got %s", ld->name,
                             tdm_config_line(root), tdm_config_describe(root, got, sizeof got));
    int rc = empty ? TDM_OK
                   : tdm_config_read_section(ld, root, "", TDM_CONFIG_SECTION_TOP, cfg, ld->marks);
    if (rc != TDM_OK)
        return rc;
    const yaml_node_t *model_at = tdm_config_mark(ld->marks, TDM_CONFIG_SECTION_TOP, "model");
    const yaml_node_t *models_at = tdm_config_mark(ld->marks, TDM_CONFIG_SECTION_TOP, "models");
    if (model_at && models_at) {
        bool models_later = tdm_config_line(models_at) > tdm_config_line(model_at);
        return tdm_config_fail(ld, models_later ? models_at : model_at,
                               models_later ? "models" : "model",
                               "give model (one model) or models (a list), not both");
    }
    rc = tdm_config_finish(cfg, tdm_config_mark(ld->marks, TDM_CONFIG_SECTION_TOP, "nodes"),
                           models_at != NULL);
    if (rc != TDM_OK)
        return tdm_error_set(ld->err, rc, "%s: %s", ld->name,
                             rc == TDM_ENOTFOUND ? "cannot form the default model path: neither "
                                                   "XDG_CACHE_HOME nor HOME is set; set "
                                                   "model.path"
                                                 : "out of memory");
    return tdm_config_check_cross(ld, cfg);
}

/* The error of a failed yaml_parser_load: TDM_ERESOURCE, or TDM_EINVALID with "NAME:LINE:
 * YAML syntax error: ...". The line comes from the problem's offset for reader errors (bad
 * UTF-8, control characters) and is never past the text's last line. */
static int syntax_error(tdm_config_loader_t *ld, const yaml_parser_t *parser, const char *text,
                        size_t len)
{
    if (parser->error == YAML_MEMORY_ERROR)
        return tdm_config_fail_memory(ld);
    size_t n_lines = 1, line = parser->problem_mark.line + 1;
    for (size_t i = 0; i + 1 < len; i++)
        n_lines += text[i] == '\n';
    if (parser->error == YAML_READER_ERROR) {
        line = 1;
        for (size_t i = 0; i < parser->problem_offset && i < len; i++)
            line += text[i] == '\n';
    }
    if (line > n_lines)
        line = n_lines;
    return tdm_error_set(ld->err, TDM_EINVALID, "%s:%zu: YAML syntax error: %s%s%s", ld->name, line,
                         parser->problem ? parser->problem : "malformed",
                         parser->context ? " " : "", parser->context ? parser->context : "");
}

/* Fails when the parser holds a second document after the first. */
static int check_single_document(tdm_config_loader_t *ld, yaml_parser_t *parser, const char *text,
                                 size_t len)
{
    yaml_document_t next;
    if (!yaml_parser_load(parser, &next))
        return syntax_error(ld, parser, text, len);
    const yaml_node_t *more = yaml_document_get_root_node(&next);
    size_t more_line = more ? tdm_config_line(more) : 0;
    yaml_document_delete(&next);
    if (more)
        return tdm_error_set(ld->err, TDM_EINVALID,
                             "%s:%zu: a second YAML document; a config file holds one", ld->name,
                             more_line);
    return TDM_OK;
}

int tdm_config_load_string(const char *text, size_t len, const char *name, tdm_config_t *cfg,
                           tdm_error_t *err)
{
    tdm_config_loader_t ld = {.name = name ? name : "<string>", .err = err};
    yaml_parser_t parser;
    yaml_document_t doc;
    tdm_config_keys(&ld.n_keys);
    int rc = tdm_config_init(cfg);
    if (rc != TDM_OK)
        return tdm_config_fail_memory(&ld);
    ld.marks = calloc(ld.n_keys, sizeof *ld.marks);
    if (!ld.marks || !yaml_parser_initialize(&parser)) {
        rc = tdm_config_fail_memory(&ld);
        goto out_free_marks;
    }
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    if (!yaml_parser_load(&parser, &doc)) {
        rc = syntax_error(&ld, &parser, text, len);
        goto out_delete_parser;
    }
    ld.doc = &doc;
    const yaml_node_t *root = yaml_document_get_root_node(&doc);
    rc = root ? check_single_document(&ld, &parser, text, len) : TDM_OK;
    if (rc == TDM_OK)
        rc = read_root(&ld, root, cfg);
    if (rc == TDM_OK)
        tdm_error_clear(err);
    yaml_document_delete(&doc);
out_delete_parser:
    yaml_parser_delete(&parser);
out_free_marks:
    free(ld.node_marks);
    free(ld.model_marks);
    free(ld.marks);
    if (rc != TDM_OK)
        tdm_config_free(cfg);
    return rc;
}

int tdm_config_load_file(const char *path, tdm_config_t *cfg, tdm_error_t *err)
{
    char *text;
    size_t len;
    memset(cfg, 0, sizeof *cfg);
    int rc = tdm_read_file(path, TDM_CONFIG_MAX_FILE_BYTES, &text, &len, err);
    if (rc != TDM_OK)
        return rc;
    rc = tdm_config_load_string(text, len, path, cfg, err);
    free(text);
    return rc;
}
