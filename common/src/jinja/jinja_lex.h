/* jinja_lex.h - the Jinja lexer's tokens (jinja_lex.c). */
#ifndef TANDEM_JINJA_LEX_H
#define TANDEM_JINJA_LEX_H

#include "jinja_int.h"

typedef enum jj_tok_kind {
    JT_TEXT,
    JT_VAR_BEGIN,
    JT_VAR_END,
    JT_BLOCK_BEGIN,
    JT_BLOCK_END,
    JT_NAME,
    JT_STRING,
    JT_INT,
    JT_FLOAT,
    JT_OP,
    JT_EOF
} jj_tok_kind_t;

typedef struct jj_token {
    jj_tok_kind_t kind;
    size_t off;    /* offset in the source */
    int line, col; /* its line and column (1-based), as jj_where gives them */
    const char *s; /* JT_TEXT, JT_NAME, JT_STRING (undecoded), numbers, JT_OP */
    size_t n;
} jj_token_t;

typedef struct jj_lex {
    const char *src;
    jj_token_t *toks; /* malloc'd */
    size_t n, cap;
    tdm_error_t *err;
} jj_lex_t;

/* Tokens of src into lx (lx->toks freed by the caller with free()); 0 or TDM_EINVALID /
 * TDM_ERESOURCE with "line:column: what" in lx->err. */
int jj_lex(jj_lex_t *lx, const char *src, size_t len, const tdm_jinja_options_t *opt);

/* Line and column (1-based) of byte offset off in src. */
void jj_where(const char *src, size_t off, int *line, int *col);

#endif
