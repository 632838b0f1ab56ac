/* prompt.c - the prompt rule (tandem/prompt.h): raw text or chat messages -> token ids. */
#include "tandem/prompt.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Renders msgs with the Jinja template t (bos/eos texts from pick when there is one). */
static int render_jinja(const tdm_jinja_t *t, const tdm_chat_pick_t *pick,
                        const tdm_prompt_input_t *in, const tdm_chat_message_t *msgs, size_t n,
                        char **text, size_t *len, tdm_error_t *err)
{
    tdm_chat_jinja_input_t ji = {.msgs = msgs,
                                 .n = n,
                                 .tools = in->tools,
                                 .add_generation_prompt = !in->no_generation_prompt,
                                 .bos_token = pick ? pick->bos_token : "",
                                 .eos_token = pick ? pick->eos_token : "",
                                 .kwargs = in->template_kwargs,
                                 .now = in->now ? in->now : -1};
    return tdm_chat_apply_jinja(t, &ji, text, len, in->raised, err);
}

/* The Jinja template in is rendered with: the request's, else the picked one; NULL: built-in. */
static const tdm_jinja_t *jinja_of(const tdm_chat_pick_t *pick, const tdm_prompt_input_t *in)
{
    return in->jinja ? in->jinja : pick ? pick->jinja : NULL;
}

/* Renders the chat of in with pick into *text (heap, *len bytes). */
static int render_chat(const tdm_chat_pick_t *pick, const tdm_prompt_input_t *in, char **text,
                       size_t *len, tdm_error_t *err)
{
    if (!pick && !in->jinja)
        return tdm_error_set(err, TDM_EINVALID, "chat: no chat template");
    const tdm_chat_message_t *msgs = in->messages;
    size_t n = in->n_messages;
    tdm_chat_message_t *all = NULL;
    if (in->system) {
        if (!tdm_add_size(n, 1, &n) || !(all = malloc(n * sizeof *all)))
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        all[0] = (tdm_chat_message_t){.role = "system", .content = in->system};
        if (in->n_messages)
            memcpy(all + 1, in->messages, in->n_messages * sizeof *all);
        msgs = all;
    }
    int rc;
    const tdm_jinja_t *t = jinja_of(pick, in);
    if (t && in->tools && in->tools[0] && !tdm_jinja_reads(t, "tools")) {
        /* a template that renders no tools: the Hermes text carries them (tandem/chat.h) */
        tdm_chat_inline_t il;
        rc = tdm_chat_tools_inline(msgs, n, in->tools, &il, err);
        if (rc == TDM_OK)
            rc = render_jinja(t, pick, in, il.msgs, il.n, text, len, err);
        tdm_chat_inline_release(&il);
    } else if (t) {
        rc = render_jinja(t, pick, in, msgs, n, text, len, err);
    } else {
        const char *sys = pick->default_system[0] ? pick->default_system : NULL;
        rc = tdm_chat_apply_tools(pick->tmpl, msgs, n, in->tools, !in->no_generation_prompt, sys,
                                  text, len, err);
    }
    free(all);
    return rc;
}

int tdm_prompt_encode(const tdm_tokenizer_t *tok, const tdm_chat_pick_t *pick,
                      const tdm_prompt_input_t *in, tdm_token_t **ids, size_t *n_ids,
                      char **rendered, tdm_error_t *err)
{
    *ids = NULL;
    *n_ids = 0;
    if (rendered)
        *rendered = NULL;
    int rc;
    if (in->text) {
        rc = tdm_tokenizer_encode(tok, in->text, in->text_len,
                                  tdm_tokenizer_add_bos(tok) && !in->no_bos, true, ids, n_ids, err);
        if (rc != TDM_OK) {
            *ids = NULL;
            *n_ids = 0;
        }
        return rc;
    }
    char *text = NULL;
    size_t len = 0;
    rc = render_chat(pick, in, &text, &len, err);
    if (rc != TDM_OK)
        return rc;
    bool add_bos = tdm_tokenizer_add_bos(tok) && !in->no_bos;
    size_t skip = 0;
    if (jinja_of(pick, in)) {
        /* llama.cpp's --jinja rule: the tokenizer's BOS replaces the BOS text the template
         * wrote, so there is exactly one */
        size_t bl = pick ? strlen(pick->bos_token) : 0;
        if (add_bos && bl && len >= bl && memcmp(text, pick->bos_token, bl) == 0)
            skip = bl;
    } else if (tdm_chat_template_writes_bos(pick->tmpl)) {
        add_bos = false; /* the built-in wrote BOS's text itself (Llama-3, Llama-2, Gemma) */
    }
    rc = tdm_tokenizer_encode(tok, text + skip, len - skip, add_bos, true, ids, n_ids, err);
    if (rc != TDM_OK) {
        *ids = NULL;
        *n_ids = 0;
    }
    if (rc == TDM_OK && rendered)
        *rendered = text;
    else
        free(text);
    return rc;
}

/* Offset of the first byte of s that is not ASCII whitespace (Python's str.lstrip for ASCII). */
static size_t lstrip_at(const char *s)
{
    size_t i = 0;
    while (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r' || s[i] == '\v' ||
           s[i] == '\f')
        i++;
    return i;
}

/* Whether s[n] is well-formed UTF-8. */
static bool utf8_valid(const char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t len = tdm_utf8_decode((const unsigned char *)s + i, n - i, &cp);
        if (!len)
            return false;
        i += len;
    }
    return true;
}

int tdm_prompt_bad_word(const tdm_tokenizer_t *tok, const char *text, size_t index,
                        tdm_sampling_params_t *sp, tdm_error_t *err)
{
    size_t len = strlen(text);
    const char *word = text + lstrip_at(text);
    char field[40];
    snprintf(field, sizeof field, "bad_words[%zu]", index);
    if (len > TDM_SAMPLING_MAX_BAD_WORD_BYTES)
        return tdm_error_set_field(err, TDM_EINVALID, field, "%s is %zu bytes, at most %d", field,
                                   len, TDM_SAMPLING_MAX_BAD_WORD_BYTES);
    if (!utf8_valid(text, len))
        return tdm_error_set_field(err, TDM_EINVALID, field, "%s is not valid UTF-8", field);
    if (!word[0])
        return tdm_error_set_field(err, TDM_EINVALID, field,
                                   "%s must have 1..%d bytes besides leading spaces", field,
                                   TDM_SAMPLING_MAX_BAD_WORD_BYTES);
    char spaced[TDM_SAMPLING_MAX_BAD_WORD_BYTES + 2];
    snprintf(spaced, sizeof spaced, " %s", word);
    tdm_token_t *a = NULL, *b = NULL;
    size_t na = 0, nb = 0;
    int rc = tdm_tokenizer_encode(tok, word, strlen(word), false, false, &a, &na, err);
    if (rc == TDM_OK)
        rc = tdm_tokenizer_encode(tok, spaced, strlen(spaced), false, false, &b, &nb, err);
    if (rc == TDM_OK && na == 0)
        rc = tdm_error_set_field(err, TDM_EINVALID, field, "%s has no tokens", field);
    if (rc == TDM_OK)
        rc = tdm_sampling_bad_seq_add(sp, a, (uint32_t)na, err);
    if (rc == TDM_OK && nb == na && b[0] != a[0])
        rc = tdm_sampling_bad_seq_add(sp, b, (uint32_t)nb, err);
    free(a);
    free(b);
    return rc;
}
