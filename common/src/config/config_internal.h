/* config_internal.h - what the config module's files share: the key table, the loader's state
 * and the readers and checks built on them.
 *
 * A config key is decided in one place: its row in the key table (config_keys.c), which gives
 * its section, name, type, bounds, default and doc line. The loader (config_load.c reading
 * values with config_value.c), the defaults (config.c), the dumper and the docs table
 * (config_dump.c) all walk the table; a key is never spelled anywhere else, except by the
 * checks that involve several keys (config_check.c), which look their keys up by name.
 */
#ifndef TANDEM_CONFIG_INTERNAL_H
#define TANDEM_CONFIG_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>

#include <yaml.h>

#include "tandem/config.h"

#define TDM_CONFIG_N_OF(a) (sizeof(a) / sizeof((a)[0]))

/* CUDA device ordinals accepted: cuda:0 .. cuda:63. */
#define TDM_CONFIG_MAX_CUDA_DEVICES 64

/* Longest dotted key path built ("nodes[1023].speculative.max_draft" fits). */
#define TDM_CONFIG_KEY_MAX 96

/* The mappings of a config file. Rows of TDM_CONFIG_SECTION_NODE and _SPECULATIVE are fields
 * of a tdm_node_config_t; all others of the tdm_config_t. */
typedef enum tdm_config_section {
    TDM_CONFIG_SECTION_TOP = 0,        /* the file's top level: the sections and nodes */
    TDM_CONFIG_SECTION_MODEL,          /* model: */
    TDM_CONFIG_SECTION_MODEL_DEFAULTS, /* model.defaults: (models[].defaults:) */
    TDM_CONFIG_SECTION_ROUTER,         /* router: */
    TDM_CONFIG_SECTION_KV,             /* kv: */
    TDM_CONFIG_SECTION_LOG,            /* log: */
    TDM_CONFIG_SECTION_SECURITY,       /* security: */
    TDM_CONFIG_SECTION_NODE,           /* one entry of nodes: */
    TDM_CONFIG_SECTION_SPECULATIVE,    /* nodes[].speculative: */
    TDM_CONFIG_N_SECTIONS,
} tdm_config_section_t;

typedef enum tdm_config_type {
    TDM_CONFIG_TYPE_BOOL,      /* bool */
    TDM_CONFIG_TYPE_INT,       /* int in [min, max] */
    TDM_CONFIG_TYPE_NUMBER,    /* double in [min, max] ((min, max] with TDM_CONFIG_MIN_OPEN) */
    TDM_CONFIG_TYPE_BYTES,     /* uint64_t, a byte size in [min, max] (tdm_config_parse_bytes) */
    TDM_CONFIG_TYPE_STRING,    /* char *, owned */
    TDM_CONFIG_TYPE_PATH,      /* char *, owned; a leading "~/" is expanded with $HOME */
    TDM_CONFIG_TYPE_ENDPOINT,  /* char *, owned; a ZeroMQ endpoint */
    TDM_CONFIG_TYPE_CURVE_KEY, /* char *, owned; a Z85 CURVE public key */
    TDM_CONFIG_TYPE_ENUM,      /* an int-sized enum, or a bool (a two-value enum) */
    TDM_CONFIG_TYPE_DEVICE,    /* tdm_node_device_t */
    TDM_CONFIG_TYPE_LIST,      /* char ** of strings, owned, with a size_t count at aux_offset */
    TDM_CONFIG_TYPE_MAPPING,   /* a nested section (sub) */
    TDM_CONFIG_TYPE_NODES,     /* the list of nodes (config_load.c reads it) */
    TDM_CONFIG_TYPE_MODELS,    /* the list of models, entries of section MODEL (config_load.c) */
    TDM_CONFIG_TYPE_REMOVED,   /* a key of earlier versions: refused, doc says what replaced it */
} tdm_config_type_t;

/* Row flags. */
enum {
    TDM_CONFIG_OPTIONAL = 1u << 0,     /* strings: null or "" leave it unset (NULL); enums: null
                                          clears the bool at aux_offset */
    TDM_CONFIG_REQUIRED = 1u << 1,     /* a node entry without it is refused */
    TDM_CONFIG_DERIVED = 1u << 2,      /* the default depends on other keys (config_finish);
                                          def_text describes it for the docs */
    TDM_CONFIG_MIN_OPEN = 1u << 3,     /* numbers: min itself is refused */
    TDM_CONFIG_POW2 = 1u << 4,         /* ints: a power of two */
    TDM_CONFIG_DECODE_ONLY = 1u << 5,  /* node keys: refused on a prefill node, and not dumped
                                          for one */
    TDM_CONFIG_DUMP_NONZERO = 1u << 6, /* dumped only when set (one of a pair of which exactly
                                          one is set after loading) */
};

/* The values of an enum key, in enum order (value i is named name(i)). */
typedef struct tdm_config_enum {
    const char *(*name)(int value); /* the config file's spelling */
    int n_values;
    int (*parse)(const char *text); /* NULL: the names only; else also aliases; -1 refused */
    const char *aliases_doc;        /* Markdown after the values in the docs, or NULL */
} tdm_config_enum_t;

/* Refuses a string value: returns true and writes why (a message without the key, cap bytes)
 * when value is not acceptable; got is how the value reads in messages ("'x'"). */
typedef bool (*tdm_config_refuse_fn)(const char *value, const char *got, char *why, size_t cap);

/* One config key. */
typedef struct tdm_config_key {
    tdm_config_section_t section;
    const char *name;
    tdm_config_type_t type;
    unsigned flags;
    size_t offset;        /* of the field in its struct (tdm_config_t or tdm_node_config_t) */
    size_t size;          /* of the field: enums are stored as int or bool */
    size_t aux_offset;    /* LIST: the size_t count; OPTIONAL ENUM: the bool "is set" */
    double min, max;      /* INT, NUMBER, BYTES: the bounds */
    double def;           /* BOOL, INT, NUMBER, BYTES, ENUM: the default */
    const char *def_text; /* STRING, PATH, ENDPOINT: the default (NULL: none);
                             with TDM_CONFIG_DERIVED: the docs' Markdown */
    const char *unit;     /* INT, NUMBER: "seconds", … in messages and docs */
    const tdm_config_enum_t *values; /* ENUM */
    tdm_config_refuse_fn refuse;     /* STRING, ENDPOINT, LIST items: extra checks */
    const char *item;                /* LIST: what an item is ("API key") */
    tdm_config_section_t sub;        /* MAPPING: the nested section */
    const char *doc;                 /* the docs' Markdown; REMOVED: what replaced it */
} tdm_config_key_t;

/* The key table, n rows in file order: sections in order, and in each its keys in the order
 * the dumper writes them and error messages list them. Cannot fail. */
const tdm_config_key_t *tdm_config_keys(size_t *n);

/* The row of key name in section, or NULL. Cannot fail. */
const tdm_config_key_t *tdm_config_key_find(tdm_config_section_t section, const char *name);

/* The row's index in the table (for marks arrays). */
size_t tdm_config_key_index(const tdm_config_key_t *key);

/* Whether section's rows are fields of a tdm_node_config_t. */
bool tdm_config_section_is_node(tdm_config_section_t section);

/* Stores v in, or reads it from, an enum field of size bytes (an int-sized enum or a bool). */
void tdm_config_enum_store(void *field, size_t size, int v);
int tdm_config_enum_load(const void *field, size_t size);

/* A ZeroMQ endpoint: tcp://HOST:PORT (PORT 1..65535), ipc://PATH or inproc://NAME. */
bool tdm_config_endpoint_valid(const char *s);

/* Writes the defaults of section's rows (and of its nested sections) into base, the
 * tdm_config_t or tdm_node_config_t the section belongs to. Strings are allocated; derived
 * ones are left NULL. Returns 0 or TDM_ERESOURCE (what was set is then owned by base). */
int tdm_config_section_defaults(tdm_config_section_t section, void *base);

/* Fills *cfg (previous contents ignored) with the table's defaults, leaving the derived ones
 * (model path and name, nodes) to tdm_config_finish. Returns 0 or TDM_ERESOURCE (then *cfg
 * holds nothing to free). */
int tdm_config_init(tdm_config_t *cfg);

/* Fills *node (previous contents ignored) with the table's defaults of a nodes[] entry.
 * Returns 0 or TDM_ERESOURCE; either way the caller frees *node with the config. */
int tdm_config_node_defaults(tdm_node_config_t *node);

/* Fills what the file left out and what depends on other keys: the model path and name, the
 * default nodes (when nodes_given is false), decode nodes' KV endpoints and each node's
 * memory budget by device. Errors: TDM_ERESOURCE, TDM_ENOTFOUND (no default model path). */
int tdm_config_finish(tdm_config_t *cfg, bool nodes_given, bool models_given);

/* ---- the loader ---- */

typedef struct tdm_config_loader {
    const char *name; /* file name for messages */
    yaml_document_t *doc;
    tdm_error_t *err;
    const yaml_node_t **marks;       /* [n_keys]: where each global key was written, or NULL */
    const yaml_node_t **node_marks;  /* [n_nodes][n_keys]: the same for each node entry */
    const yaml_node_t **model_marks; /* [n_models][n_keys]: the same for each models: entry
                                        (NULL without models:) */
    size_t n_keys;
} tdm_config_loader_t;

/* Where key name of section was written, by marks (the global marks or one node's); NULL
 * when it was not, or marks is NULL. Cannot fail. */
const yaml_node_t *tdm_config_mark(const yaml_node_t *const *marks, tdm_config_section_t section,
                                   const char *name);

/* Sets the error "NAME:LINE: key 'KEY': MESSAGE" ("NAME:LINE: MESSAGE" for key "") with KEY as
 * its field (tdm_error_t.field: "router.max_queue", "nodes[1].endpoint") and returns
 * TDM_EINVALID. */
int tdm_config_fail(tdm_config_loader_t *ld, const yaml_node_t *at, const char *key,
                    const char *fmt, ...) __attribute__((format(printf, 4, 5)));

/* Sets "NAME: out of memory" and returns TDM_ERESOURCE. */
int tdm_config_fail_memory(tdm_config_loader_t *ld);

/* The 1-based line a YAML node starts on. */
size_t tdm_config_line(const yaml_node_t *n);

/* A plain scalar that YAML reads as null: empty, "~", "null", "Null", "NULL". */
bool tdm_config_is_null(const yaml_node_t *n);

/* Describes a value for "got ..." in messages ("'x'", "a list"); may write into buf. */
const char *tdm_config_describe(const yaml_node_t *n, char *buf, size_t cap);

/* out = "path.name" (or "name" for path ""), cut to TDM_CONFIG_KEY_MAX - 1 bytes. */
void tdm_config_key_join(char *out, const char *path, const char *name);

/* Reads value v of row key (its dotted path keypath) into the field at base + key->offset.
 * MAPPING rows read their section through tdm_config_read_section. */
int tdm_config_read_value(tdm_config_loader_t *ld, const tdm_config_key_t *key,
                          const yaml_node_t *v, const char *keypath, void *base);

/* Reads the mapping map of section (path: its dotted path) into base, marking in marks (the
 * table's n_keys entries) where each key was written. */
int tdm_config_read_section(tdm_config_loader_t *ld, const yaml_node_t *map, const char *path,
                            tdm_config_section_t section, void *base, const yaml_node_t **marks);

/* Reads the nodes: list v into cfg->nodes (config_load.c): each entry over the node defaults,
 * its marks in ld->node_marks, then its own checks (tdm_config_check_node) and distinct ids. */
int tdm_config_read_nodes(tdm_config_loader_t *ld, const yaml_node_t *v, tdm_config_t *cfg);

/* Reads the models: list v into cfg->models (config_load.c): each entry a mapping of the model
 * section's keys over its defaults, its marks in ld->model_marks. */
int tdm_config_read_models(tdm_config_loader_t *ld, const yaml_node_t *v, tdm_config_t *cfg);

/* Copies src into *dst (every string and list duplicated). Returns 0 or TDM_ERESOURCE (then
 * *dst holds what was copied, for tdm_config_model_free). */
int tdm_config_model_copy(tdm_model_config_t *dst, const tdm_model_config_t *src);

/* Frees what *m owns and zeroes it. NULL-safe. */
void tdm_config_model_free(tdm_model_config_t *m);

/* ---- the checks across keys (config_check.c) ---- */

/* The checks of nodes[index] that involve several of its keys: required keys, decode-only
 * keys, memory_budget against gpu_memory_utilization. map is the entry. */
int tdm_config_check_node(tdm_config_loader_t *ld, const yaml_node_t *map, size_t index,
                          const tdm_node_config_t *node);

/* The checks across sections, once every section is read and the derived defaults are
 * filled: served model names distinct across models, every node's model listed, ZeroMQ
 * endpoints are distinct, CURVE keys all or nothing and distinct. The default
 * nodes (ld->node_marks NULL) have no marks. */
int tdm_config_check_cross(tdm_config_loader_t *ld, const tdm_config_t *cfg);

#endif /* TANDEM_CONFIG_INTERNAL_H */
