/* test_tokenizer.c - the tokenizer against llama.cpp's test vectors (five vocabularies from
 * ../shared and deepseek-llm, mpt, command-r from scripts/setup's cache, 46 texts each), round
 * trips of seeded random text and bytes, the incremental detokenizer, special tokens, metadata
 * errors and speed. */
#include "tdm_test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/gguf.h"
#include "tandem/tokenizer.h"

#define VOCAB_DIR TDM_SHARED_DIR "/testdata/tokenizer/"
#define SEPARATOR "\n__ggml_vocab_test__\n"

#if defined(__SANITIZE_ADDRESS__)
#define TDM_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TDM_TEST_SANITIZED 1
#endif
#endif

/* ---- helpers ---- */

static tdm_tokenizer_t *load_vocab_in(const char *dir, const char *name)
{
    char path[512];
    snprintf(path, sizeof path, "%sggml-vocab-%s.gguf", dir, name);
    tdm_error_t err;
    tdm_gguf_t *g = tdm_gguf_open(path, &err);
    if (!g)
        fail_msg("open %s: %s", path, err.msg);
    tdm_tokenizer_t *tok = tdm_tokenizer_new(g, &err);
    if (!tok)
        fail_msg("tokenizer %s: %s", name, err.msg);
    tdm_gguf_destroy(&g);
    assert_null(g);
    return tok;
}

static tdm_tokenizer_t *load_vocab(const char *name)
{
    return load_vocab_in(VOCAB_DIR, name);
}

static void encode_ok(const tdm_tokenizer_t *tok, const char *s, size_t n, bool bos, bool special,
                      tdm_token_t **ids, size_t *n_ids)
{
    tdm_error_t err;
    int rc = tdm_tokenizer_encode(tok, s, n, bos, special, ids, n_ids, &err);
    if (rc != TDM_OK)
        fail_msg("encode: %s", err.msg);
    assert_non_null(*ids);
}

static char *decode_ok(const tdm_tokenizer_t *tok, const tdm_token_t *ids, size_t n,
                       bool render_special, size_t *len)
{
    char *out = NULL;
    tdm_error_t err;
    int rc = tdm_tokenizer_decode(tok, ids, n, render_special, &out, len, &err);
    if (rc != TDM_OK)
        fail_msg("decode: %s", err.msg);
    return out;
}

/* Streams ids through the detokenizer one at a time; returns the concatenation (caller
 * frees). Checks that no chunk ends inside a UTF-8 character. */
static char *detok_all(const tdm_tokenizer_t *tok, const tdm_token_t *ids, size_t n,
                       bool render_special, size_t *len)
{
    tdm_detok_t d;
    tdm_detok_init(&d, tok, render_special);
    size_t cap = 64, k = 0;
    char *all = malloc(cap);
    assert_non_null(all);
    char buf[512];
    for (size_t i = 0; i <= n; i++) {
        size_t m = 0;
        int rc = i < n ? tdm_detok_push(&d, ids[i], buf, sizeof buf, &m)
                       : tdm_detok_flush(&d, buf, sizeof buf, &m);
        assert_int_equal(rc, TDM_OK);
        assert_true(m < sizeof buf && buf[m] == '\0');
        if (m > 0) {
            /* the chunk ends on a character boundary: its last lead byte is complete */
            size_t j = m - 1, cont = 0;
            while (j > 0 && ((unsigned char)buf[j] & 0xC0) == 0x80)
                j--, cont++;
            unsigned char c = (unsigned char)buf[j];
            size_t want = c < 0x80 ? 0 : c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : 1;
            assert_int_equal(cont, want);
        }
        while (k + m + 1 > cap) {
            cap *= 2;
            all = realloc(all, cap);
            assert_non_null(all);
        }
        memcpy(all + k, buf, m);
        k += m;
    }
    all[k] = '\0';
    *len = k;
    return all;
}

static bool utf8_valid(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned char c = s[i];
        size_t len;
        uint32_t v, min;
        if (c < 0x80) {
            i++;
            continue;
        } else if (c >= 0xC2 && c <= 0xDF) {
            len = 2, v = c & 0x1F, min = 0x80;
        } else if (c >= 0xE0 && c <= 0xEF) {
            len = 3, v = c & 0x0F, min = 0x800;
        } else if (c >= 0xF0 && c <= 0xF4) {
            len = 4, v = c & 0x07, min = 0x10000;
        } else {
            return false;
        }
        if (i + len > n)
            return false;
        for (size_t j = 1; j < len; j++) {
            if ((s[i + j] & 0xC0) != 0x80)
                return false;
            v = v << 6 | (s[i + j] & 0x3F);
        }
        if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
            return false;
        i += len;
    }
    return true;
}

/* decode(encode(s)) == s, and the detokenizer agrees with decode on valid UTF-8. */
static void check_round_trip(const tdm_tokenizer_t *tok, const char *s, size_t n, const char *what)
{
    tdm_token_t *ids;
    size_t n_ids, len, dlen;
    encode_ok(tok, s, n, false, false, &ids, &n_ids);
    char *back = decode_ok(tok, ids, n_ids, false, &len);
    if (len != n || memcmp(back, s, n) != 0) {
        size_t i = 0;
        while (i < n && i < len && back[i] == s[i])
            i++;
        fail_msg("%s: round trip of %zu bytes gave %zu bytes, first difference at %zu: "
                 "%02x %02x %02x %02x",
                 what, n, len, i, i < n ? (uint8_t)s[i] : 0, i + 1 < n ? (uint8_t)s[i + 1] : 0,
                 i + 2 < n ? (uint8_t)s[i + 2] : 0, i + 3 < n ? (uint8_t)s[i + 3] : 0);
    }
    if (utf8_valid((const unsigned char *)back, len)) {
        char *streamed = detok_all(tok, ids, n_ids, false, &dlen);
        if (dlen != len || memcmp(streamed, back, len) != 0)
            fail_msg("%s: detokenizer gave %zu bytes, decode %zu", what, dlen, len);
        free(streamed);
    }
    free(back);
    free(ids);
}

/* ---- test vectors ---- */

typedef struct vocab_state {
    const char *name;
    bool cached; /* its files are in scripts/setup's cache, not in ../shared */
} vocab_state_t;

/* The folder (ending in '/') that holds a vocabulary's files: ../shared/testdata/tokenizer/, or
 * for a cached one $TDM_VOCAB_DIR, else ${XDG_CACHE_HOME:-$HOME/.cache}/tandem/vocab/ (what
 * scripts/setup fills). False when a cached vocabulary's file is not there. */
static bool vocab_dir(const vocab_state_t *v, char *dir, size_t cap)
{
    if (!v->cached) {
        snprintf(dir, cap, "%s", VOCAB_DIR);
        return true;
    }
    const char *env = getenv("TDM_VOCAB_DIR"), *xdg = getenv("XDG_CACHE_HOME");
    const char *home = getenv("HOME");
    if (env && *env)
        snprintf(dir, cap, "%s/", env);
    else if (xdg && *xdg)
        snprintf(dir, cap, "%s/tandem/vocab/", xdg);
    else
        snprintf(dir, cap, "%s/.cache/tandem/vocab/", home ? home : "");
    char path[600];
    snprintf(path, sizeof path, "%sggml-vocab-%s.gguf.out", dir, v->name);
    FILE *f = fopen(path, "rb");
    if (f)
        fclose(f);
    return f != NULL;
}

static void test_vectors(void **state)
{
    const vocab_state_t *vs = *state;
    const char *name = vs->name;
    char dir[512];
    if (!vocab_dir(vs, dir, sizeof dir)) {
        printf("%s: skipped, no vectors in %s (run scripts/setup)\n", name, dir);
        skip();
    }
    tdm_tokenizer_t *tok = load_vocab_in(dir, name);
    char path[600], *inp, *outp;
    size_t inp_len, out_len;
    tdm_error_t err;
    snprintf(path, sizeof path, "%sggml-vocab-%s.gguf.inp", dir, name);
    assert_int_equal(tdm_read_file(path, 1 << 20, &inp, &inp_len, &err), TDM_OK);
    snprintf(path, sizeof path, "%sggml-vocab-%s.gguf.out", dir, name);
    assert_int_equal(tdm_read_file(path, 1 << 20, &outp, &out_len, &err), TDM_OK);

    size_t n_cases = 0, n_pass = 0, n_split = 0;
    char *text = inp, *line = outp;
    for (;;) {
        char *sep = strstr(text, SEPARATOR);
        if (!sep)
            break;
        size_t tlen = (size_t)(sep - text);
        char *eol = strchr(line, '\n');
        assert_non_null(eol);
        *eol = '\0';

        tdm_token_t want[512];
        size_t n_want = 0;
        for (char *p = line, *end; *p; p = end) {
            long v = strtol(p, &end, 10);
            if (end == p)
                break;
            assert_true(n_want < 512);
            want[n_want++] = (tdm_token_t)v;
        }

        tdm_token_t *ids;
        size_t n_ids;
        encode_ok(tok, text, tlen, false, false, &ids, &n_ids);
        bool same = n_ids == n_want && memcmp(ids, want, n_ids * sizeof *ids) == 0;
        if (!same) {
            fprintf(stderr, "%s case %zu '%.*s':\n  want", name, n_cases, (int)tlen, text);
            for (size_t i = 0; i < n_want; i++)
                fprintf(stderr, " %d", want[i]);
            fprintf(stderr, "\n  got ");
            for (size_t i = 0; i < n_ids; i++)
                fprintf(stderr, " %d", ids[i]);
            fprintf(stderr, "\n");
        }

        /* decode is the inverse; the detokenizer streams the same text */
        size_t len, dlen;
        char *back = decode_ok(tok, ids, n_ids, false, &len);
        bool round = len == tlen && memcmp(back, text, tlen) == 0;
        if (!round)
            fprintf(stderr, "%s case %zu: decode gave '%s'\n", name, n_cases, back);
        char *streamed = detok_all(tok, ids, n_ids, false, &dlen);
        bool stream = dlen == len && memcmp(streamed, back, len) == 0;
        if (!stream)
            fprintf(stderr, "%s case %zu: detok gave '%s'\n", name, n_cases, streamed);
        /* count the cases where a character is split across tokens */
        for (size_t i = 0; i < n_ids; i++) {
            char b[64];
            int n = tdm_tokenizer_token_bytes(tok, ids[i], false, b, sizeof b);
            assert_true(n >= 0 && n < 64);
            if (!utf8_valid((const unsigned char *)b, (size_t)n)) {
                n_split++;
                break;
            }
        }
        free(streamed);
        free(back);
        free(ids);

        n_cases++;
        n_pass += same && round && stream;
        text = sep + strlen(SEPARATOR);
        line = eol + 1;
    }
    printf("%s: %zu/%zu test vectors pass (%zu with a character split across tokens)\n", name,
           n_pass, n_cases, n_split);
    assert_int_equal(n_cases, 46);
    assert_int_equal(n_pass, n_cases);
    free(inp);
    free(outp);
    tdm_tokenizer_destroy(&tok);
    assert_null(tok);
}

/* A vocabulary whose architecture Tandem does not run (mpt, command-r) still tokenizes (the
 * vectors above), while the engine's reader refuses the architecture by name. */
static void test_refused_architecture(void **state)
{
    const vocab_state_t *vs = *state;
    char dir[512], path[600], want[96];
    if (!vocab_dir(vs, dir, sizeof dir)) {
        printf("%s: skipped, no vectors in %s (run scripts/setup)\n", vs->name, dir);
        skip();
    }
    snprintf(path, sizeof path, "%sggml-vocab-%s.gguf", dir, vs->name);
    tdm_error_t err;
    tdm_gguf_t *g = tdm_gguf_open(path, &err);
    assert_non_null(g);
    tdm_llama_hparams_t hp;
    assert_int_equal(tdm_gguf_llama_hparams(g, &hp, &err), TDM_EINVALID);
    snprintf(want, sizeof want, "general.architecture '%s' is not supported", vs->name);
    if (!strstr(err.msg, want))
        fail_msg("%s: message '%s' lacks \"%s\"", vs->name, err.msg, want);
    tdm_gguf_destroy(&g);
}

/* ---- seeded random round trips ---- */

static uint64_t rng_next(uint64_t *s)
{
    /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static size_t put_utf8(uint32_t cp, char *out)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* A random code point: mostly ASCII and whitespace, then scripts the vectors touch, then any
 * scalar value. */
static uint32_t random_cp(uint64_t *s)
{
    uint64_t r = rng_next(s);
    uint32_t x = (uint32_t)(r >> 32);
    switch (r % 12) {
    case 0:
    case 1:
    case 2: return 0x20 + x % 0x5F;
    case 3: return (uint8_t) " \n\t\r  0123456789'"[x % 17];
    case 4: return 0xA0 + x % 0x60;
    case 5: return 0x370 + x % 0x190;
    case 6: return 0x4E00 + x % 0x5200;
    case 7: return 0xAC00 + x % 0x2BA4;
    case 8: return 0x1780 + x % 0x80;
    case 9: return 0x1F300 + x % 0x400;
    case 10: return 0x2000 + x % 0x70; /* punctuation and odd spaces */
    default: {
        uint32_t cp = 1 + x % 0x10FFFF;
        return cp >= 0xD800 && cp <= 0xDFFF ? 0xFFFD : cp;
    }
    }
}

/* GPT-2's bytes_to_unicode, to ask a byte-level vocabulary which bytes it can spell. */
static uint32_t byte_to_cp(uint32_t b)
{
    bool self = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    if (self)
        return b;
    uint32_t n = 0;
    for (uint32_t c = 0; c < b; c++)
        n += !((c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE);
    return 256 + n;
}

/* Which bytes the vocabulary can round-trip: all for SPM (<0xXX> fallback); for byte-level
 * BPE those whose character is a normal token. Some vocabularies lack bytes that never occur
 * in UTF-8 (falcon and starcoder lack a few; deepseek-coder made C0, C1 and F5..FF user-defined
 * tokens, which decode as their text). */
static void spellable_bytes(const tdm_tokenizer_t *tok, bool ok[256])
{
    for (uint32_t b = 0; b < 256; b++) {
        if (tdm_tokenizer_kind(tok) == TDM_TOKENIZER_SPM) {
            ok[b] = true;
            continue;
        }
        char s[4];
        size_t n = put_utf8(byte_to_cp(b), s);
        tdm_token_t id = tdm_tokenizer_find(tok, s, n);
        ok[b] = id >= 0 && tdm_tokenizer_attr(tok, id) == TDM_TOKEN_NORMAL;
    }
}

static void test_random_round_trip(void **state)
{
    const char *name = ((const vocab_state_t *)*state)->name;
    tdm_tokenizer_t *tok = load_vocab(name);
    bool ok[256];
    spellable_bytes(tok, ok);
    size_t n_missing = 0;
    for (int b = 0; b < 256; b++)
        n_missing += !ok[b];
    uint64_t seed = 0x5EED0001;
    char buf[4 * 200 + 1];
    char what[64];
    for (int it = 0; it < 300; it++) {
        size_t n_cp = (size_t)(rng_next(&seed) % 200), n = 0;
        for (size_t i = 0; i < n_cp; i++) {
            uint32_t cp = random_cp(&seed);
            /* SentencePiece cannot tell U+2581 from an escaped space */
            if (cp == 0x2581 && tdm_tokenizer_kind(tok) == TDM_TOKENIZER_SPM)
                continue;
            size_t m = put_utf8(cp, buf + n);
            bool all = true;
            for (size_t j = 0; j < m; j++)
                all &= ok[(uint8_t)buf[n + j]];
            n += all ? m : 0;
        }
        snprintf(what, sizeof what, "%s utf-8 #%d", name, it);
        check_round_trip(tok, buf, n, what);
    }
    for (int it = 0; it < 300; it++) {
        size_t n = (size_t)(rng_next(&seed) % 300);
        for (size_t i = 0; i < n; i++) {
            uint8_t b = (uint8_t)(rng_next(&seed) & 0xFF);
            buf[i] = ok[b] ? (char)b : 'x';
        }
        snprintf(what, sizeof what, "%s bytes #%d", name, it);
        check_round_trip(tok, buf, n, what);
    }
    printf("%s: 600 random round trips pass (%zu bytes not spellable)\n", name, n_missing);
    tdm_tokenizer_destroy(&tok);
}

/* ---- detokenizer ---- */

static void test_detok_split_chars(void **state)
{
    (void)state;
    tdm_tokenizer_t *tok = load_vocab("gpt-2");
    /* U+1F999 (4 bytes) has no token of its own in GPT-2: its bytes span several tokens. */
    const char *s = "llama \xf0\x9f\xa6\x99 and \xe4\xbd\xa0\xe5\xa5\xbd!";
    tdm_token_t *ids;
    size_t n_ids;
    encode_ok(tok, s, strlen(s), false, false, &ids, &n_ids);
    tdm_detok_t d;
    tdm_detok_init(&d, tok, false);
    char out[64];
    size_t m, total = 0;
    bool held = false;
    for (size_t i = 0; i < n_ids; i++) {
        assert_int_equal(tdm_detok_push(&d, ids[i], out, sizeof out, &m), TDM_OK);
        held |= d.n_pending > 0;
        total += m;
    }
    assert_true(held);
    assert_int_equal(total, strlen(s));

    /* A character cut short: flush gives one U+FFFD for it. */
    tdm_token_t lead = tdm_tokenizer_find(tok, "\xc3\xb0", 2); /* byte 0xF0 as U+00F0 */
    assert_true(lead >= 0);
    char b[16];
    assert_int_equal(tdm_tokenizer_token_bytes(tok, lead, false, b, sizeof b), 1);
    assert_int_equal((unsigned char)b[0], 0xF0);
    tdm_detok_init(&d, tok, false);
    assert_int_equal(tdm_detok_push(&d, lead, out, sizeof out, &m), TDM_OK);
    assert_int_equal(m, 0);
    assert_int_equal(tdm_detok_flush(&d, out, 25, &m), TDM_OK);
    assert_string_equal(out, "\xef\xbf\xbd");
    assert_int_equal(d.n_pending, 0);

    /* An incomplete character followed by ASCII: U+FFFD then the ASCII. */
    tdm_token_t a = tdm_tokenizer_find(tok, "a", 1);
    assert_true(a >= 0);
    assert_int_equal(tdm_detok_push(&d, lead, out, sizeof out, &m), TDM_OK);
    assert_int_equal(tdm_detok_push(&d, a, out, sizeof out, &m), TDM_OK);
    assert_string_equal(out, "\xef\xbf\xbd"
                             "a");

    /* Too small a buffer consumes nothing. */
    tdm_token_t hello = tdm_tokenizer_find(tok, "Hello", 5);
    assert_true(hello >= 0);
    assert_int_equal(tdm_detok_push(&d, hello, out, 3, &m), TDM_ERESOURCE);
    assert_int_equal(tdm_detok_push(&d, hello, out, sizeof out, &m), TDM_OK);
    assert_string_equal(out, "Hello");
    assert_int_equal(
        tdm_detok_push(&d, (tdm_token_t)tdm_tokenizer_n_vocab(tok), out, sizeof out, &m),
        TDM_EINVALID);
    free(ids);
    tdm_tokenizer_destroy(&tok);
}

static void test_spm_space_prefix(void **state)
{
    (void)state;
    tdm_tokenizer_t *tok = load_vocab("llama-spm");
    assert_int_equal(tdm_tokenizer_kind(tok), TDM_TOKENIZER_SPM);
    tdm_token_t *ids;
    size_t n_ids, len;
    encode_ok(tok, "Hello world", 11, true, false, &ids, &n_ids);
    assert_true(n_ids >= 3);
    assert_int_equal(ids[0], 1); /* BOS */
    size_t plen;
    const char *p = tdm_tokenizer_piece(tok, ids[1], &plen);
    assert_true(plen >= 3 && memcmp(p, "\xe2\x96\x81", 3) == 0);
    char *back = decode_ok(tok, ids, n_ids, false, &len);
    assert_string_equal(back, "Hello world");
    free(back);
    back = detok_all(tok, ids, n_ids, false, &len);
    assert_string_equal(back, "Hello world");
    free(back);
    back = decode_ok(tok, ids, n_ids, true, &len);
    assert_string_equal(back, "<s> Hello world");
    free(back);
    free(ids);
    tdm_tokenizer_destroy(&tok);
}

/* ---- special tokens ---- */

static void test_special_tokens(void **state)
{
    (void)state;
    tdm_tokenizer_t *tok = load_vocab("gpt-2");
    const char *s = "a<|endoftext|>b";
    tdm_token_t *ids;
    size_t n_ids, len;

    encode_ok(tok, s, strlen(s), false, true, &ids, &n_ids);
    assert_int_equal(n_ids, 3);
    assert_int_equal(ids[1], 50256);
    char *back = decode_ok(tok, ids, n_ids, true, &len);
    assert_string_equal(back, s);
    free(back);
    back = decode_ok(tok, ids, n_ids, false, &len);
    assert_string_equal(back, "ab");
    free(back);
    free(ids);

    encode_ok(tok, s, strlen(s), false, false, &ids, &n_ids);
    assert_true(n_ids > 3);
    for (size_t i = 0; i < n_ids; i++)
        assert_int_not_equal(ids[i], 50256);
    back = decode_ok(tok, ids, n_ids, false, &len);
    assert_string_equal(back, s);
    free(back);
    free(ids);

    assert_int_equal(tdm_tokenizer_attr(tok, 50256), TDM_TOKEN_CONTROL);
    assert_int_equal(tdm_tokenizer_bos(tok), 50256);
    assert_int_equal(tdm_tokenizer_eos(tok), 50256);
    assert_true(tdm_tokenizer_is_eog(tok, 50256));
    assert_false(tdm_tokenizer_is_eog(tok, 0));
    assert_false(tdm_tokenizer_add_bos(tok));
    assert_string_equal(tdm_tokenizer_pre(tok), "gpt-2");
    assert_int_equal(tdm_tokenizer_n_vocab(tok), 50257);
    char b[32];
    assert_int_equal(tdm_tokenizer_token_bytes(tok, 50256, false, b, sizeof b), 0);
    assert_int_equal(tdm_tokenizer_token_bytes(tok, 50256, true, b, sizeof b), 13);
    assert_int_equal(tdm_tokenizer_token_bytes(tok, -1, true, b, sizeof b), TDM_EINVALID);
    assert_null(tdm_tokenizer_piece(tok, 50257, &len));
    tdm_token_t bad[2] = {0, 50257};
    char *out = NULL;
    tdm_error_t err;
    assert_int_equal(tdm_tokenizer_decode(tok, bad, 2, false, &out, &len, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "index 1"));
    tdm_tokenizer_destroy(&tok);

    /* Longest match first: starcoder has <pr> and <pr_status>. */
    tok = load_vocab("starcoder");
    encode_ok(tok, "<pr_status><pr>", 15, false, true, &ids, &n_ids);
    assert_int_equal(n_ids, 2);
    assert_int_equal(ids[0], 19);
    assert_int_equal(ids[1], 18);
    free(ids);
    tdm_tokenizer_destroy(&tok);

    /* User-defined tokens are split out even without parse_special (deepseek-coder); control
     * tokens only with it. End of turn found by its text. */
    tok = load_vocab("deepseek-coder");
    const char *bos = "<\xef\xbd\x9c"
                      "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>";
    encode_ok(tok, bos, strlen(bos), false, true, &ids, &n_ids);
    assert_int_equal(n_ids, 1);
    assert_int_equal(ids[0], 32013);
    free(ids);
    encode_ok(tok, bos, strlen(bos), false, false, &ids, &n_ids);
    assert_true(n_ids > 1);
    free(ids);
    encode_ok(tok, "x<|EOT|>", 8, true, false, &ids, &n_ids);
    assert_int_equal(n_ids, 3);
    assert_int_equal(ids[0], 32013);
    assert_int_equal(ids[2], 32021);
    free(ids);
    assert_int_equal(tdm_tokenizer_eot(tok), 32021);
    assert_true(tdm_tokenizer_is_eog(tok, 32021));
    assert_true(tdm_tokenizer_is_eog(tok, 32014));
    assert_true(tdm_tokenizer_add_bos(tok));
    tdm_tokenizer_destroy(&tok);

    /* SPM: <s> only with parse_special; the text after it gets the space prefix. */
    tok = load_vocab("llama-spm");
    encode_ok(tok, "<s>Hi", 5, false, true, &ids, &n_ids);
    assert_true(n_ids >= 2);
    assert_int_equal(ids[0], 1);
    size_t plen;
    const char *p = tdm_tokenizer_piece(tok, ids[1], &plen);
    assert_true(plen >= 3 && memcmp(p, "\xe2\x96\x81", 3) == 0);
    free(ids);
    encode_ok(tok, "<s>Hi", 5, false, false, &ids, &n_ids);
    for (size_t i = 0; i < n_ids; i++)
        assert_int_not_equal(ids[i], 1);
    free(ids);
    assert_int_equal(tdm_tokenizer_eos(tok), 2);
    assert_true(tdm_tokenizer_is_eog(tok, 2));
    assert_int_equal(tdm_tokenizer_eot(tok), -1);
    tdm_tokenizer_destroy(&tok);
}

/* ---- metadata errors ---- */

static tdm_tokenizer_t *tiny_tokenizer(const char *model, const char *pre, tdm_error_t *err)
{
    static const char *const tokens[] = {"a", "b", "ab", "\xc4\xa0"};
    static const char *const merges[] = {"a b"};
    tdm_gguf_writer_t *w = tdm_gguf_writer_new();
    assert_non_null(w);
    assert_int_equal(tdm_gguf_writer_set_str(w, "tokenizer.ggml.model", model), TDM_OK);
    if (pre)
        assert_int_equal(tdm_gguf_writer_set_str(w, "tokenizer.ggml.pre", pre), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", tokens, 4), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", merges, 1), TDM_OK);
    void *data;
    size_t size;
    assert_int_equal(tdm_gguf_writer_to_memory(w, &data, &size), TDM_OK);
    tdm_gguf_writer_destroy(&w);
    tdm_gguf_t *g = tdm_gguf_open_memory(data, size, err);
    assert_non_null(g);
    tdm_tokenizer_t *tok = tdm_tokenizer_new(g, err);
    tdm_gguf_destroy(&g);
    free(data);
    return tok;
}

static void test_metadata_errors(void **state)
{
    (void)state;
    tdm_error_t err;
    tdm_tokenizer_t *tok = tiny_tokenizer("gpt2", "no-such-pre", &err);
    assert_null(tok);
    assert_int_equal(err.code, TDM_EINVALID);
    assert_non_null(strstr(err.msg, "no-such-pre"));
    assert_non_null(strstr(err.msg, "smollm"));

    tok = tiny_tokenizer("bert", NULL, &err);
    assert_null(tok);
    assert_int_equal(err.code, TDM_EINVALID);
    assert_non_null(strstr(err.msg, "bert"));

    /* No pre key: "default"; the merge applies. */
    tok = tiny_tokenizer("gpt2", NULL, &err);
    assert_non_null(tok);
    assert_string_equal(tdm_tokenizer_pre(tok), "default");
    tdm_token_t *ids;
    size_t n_ids;
    encode_ok(tok, "ab a", 4, true, true, &ids, &n_ids);
    assert_int_equal(n_ids, 3); /* no BOS in this vocabulary */
    assert_int_equal(ids[0], 2);
    assert_int_equal(ids[1], 3);
    assert_int_equal(ids[2], 0);
    free(ids);
    tdm_tokenizer_destroy(&tok);
    tdm_tokenizer_destroy(&tok); /* NULL is fine */
}

/* A byte-level vocabulary: the 256 byte characters (ids 0..255 in byte order), then "12",
 * "123", "1234" and "'S" with their merges; the regexes decide which merges can apply. */
static tdm_tokenizer_t *digit_tokenizer(const char *pre, tdm_error_t *err)
{
    static char bytes[256][4];
    const char *tokens[260];
    for (uint32_t b = 0; b < 256; b++) {
        size_t n = put_utf8(byte_to_cp(b), bytes[b]);
        bytes[b][n] = '\0';
        tokens[b] = bytes[b];
    }
    tokens[256] = "12";
    tokens[257] = "123";
    tokens[258] = "1234";
    tokens[259] = "'S";
    static const char *const merges[] = {"1 2", "12 3", "123 4", "' S"};
    tdm_gguf_writer_t *w = tdm_gguf_writer_new();
    assert_non_null(w);
    assert_int_equal(tdm_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2"), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_str(w, "tokenizer.ggml.pre", pre), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", tokens, 260), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", merges, 4), TDM_OK);
    void *data;
    size_t size;
    assert_int_equal(tdm_gguf_writer_to_memory(w, &data, &size), TDM_OK);
    tdm_gguf_writer_destroy(&w);
    tdm_gguf_t *g = tdm_gguf_open_memory(data, size, err);
    assert_non_null(g);
    tdm_tokenizer_t *tok = tdm_tokenizer_new(g, err);
    tdm_gguf_destroy(&g);
    free(data);
    return tok;
}

/* Each supported pre-tokenizer compiles and splits digits and contractions its own way. */
static void test_pre_tokenizers(void **state)
{
    (void)state;
    static const struct {
        const char *pre;
        const char *digits;     /* tokens of "1234" */
        bool upper_contraction; /* "'S" is one pre-token */
    } cases[] = {
        {"gpt-2", "1234", false},        {"smollm", "1|2|3|4", false},
        {"starcoder", "1|2|3|4", false}, {"refact", "1|2|3|4", false},
        {"llama3", "123|4", true},       {"llama-bpe", "123|4", true},
        {"qwen2", "1|2|3|4", true},      {"deepseek-coder", "1|2|3|4", false},
        {"falcon", "123|4", false},      {"default", "123|4", false},
        {"mpt", "1234", false},          {"command-r", "1|2|3|4", false},
        {"deepseek-llm", "1234", false},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        tdm_error_t err;
        tdm_tokenizer_t *tok = digit_tokenizer(cases[c].pre, &err);
        if (!tok)
            fail_msg("%s: %s", cases[c].pre, err.msg);
        tdm_token_t *ids;
        size_t n_ids;
        char got[64] = "";
        encode_ok(tok, "1234", 4, false, false, &ids, &n_ids);
        for (size_t i = 0; i < n_ids; i++) {
            size_t len;
            const char *p = tdm_tokenizer_piece(tok, ids[i], &len);
            snprintf(got + strlen(got), sizeof got - strlen(got), "%s%.*s", i ? "|" : "", (int)len,
                     p);
        }
        if (strcmp(got, cases[c].digits) != 0)
            fail_msg("%s: \"1234\" gave %s, expected %s", cases[c].pre, got, cases[c].digits);
        free(ids);
        encode_ok(tok, "'S", 2, false, false, &ids, &n_ids);
        if ((n_ids == 1) != cases[c].upper_contraction)
            fail_msg("%s: \"'S\" gave %zu tokens", cases[c].pre, n_ids);
        free(ids);
        const char *mixed = "It'S 12345 \xe4\xbd\xa0\n\n  x\r\n\t!";
        check_round_trip(tok, mixed, strlen(mixed), cases[c].pre);
        /* long runs that make regexes backtrack stay linear and within PCRE2's limits */
        static const char *const fills[] = {" ", " \n", "1", "'", "\xc2\x85"};
        size_t big = 64 * 1024;
        char *s = malloc(big);
        assert_non_null(s);
        for (size_t f = 0; f < sizeof fills / sizeof fills[0]; f++) {
            size_t lf = strlen(fills[f]), k = 0;
            for (; k + lf <= big - 1; k += lf)
                memcpy(s + k, fills[f], lf);
            s[k++] = 'x';
            check_round_trip(tok, s, k, cases[c].pre);
        }
        free(s);
        tdm_tokenizer_destroy(&tok);
    }
}

/* ---- speed ---- */

static char *english_text(size_t n)
{
    static const char *const words[] = {
        "the",           "quick",   "brown",   "fox",       "jumps",  "over",     "lazy",
        "dog",           "serving", "systems", "prefill",   "decode", "tokens",   "latency",
        "throughput",    "and",     "of",      "a",         "to",     "in",       "is",
        "disaggregated", "cache",   "memory",  "GPU's",     "it's",   "requests", "2024",
        "model",         "weights", "batch",   "scheduler", "you'll", "Hello",    "world"};
    static const char *const seps[] = {" ", " ", " ", " ", " ", ", ", ". ", "\n", "; ", " - "};
    char *s = malloc(n + 64);
    assert_non_null(s);
    uint64_t seed = 42;
    size_t k = 0;
    while (k < n) {
        const char *w = words[rng_next(&seed) % (sizeof words / sizeof words[0])];
        const char *sp = seps[rng_next(&seed) % (sizeof seps / sizeof seps[0])];
        size_t lw = strlen(w), ls = strlen(sp);
        if (k + lw + ls > n)
            break;
        memcpy(s + k, w, lw);
        memcpy(s + k + lw, sp, ls);
        k += lw + ls;
    }
    s[k] = '\0';
    return s;
}

static void test_speed(void **state)
{
    const char *name = ((const vocab_state_t *)*state)->name;
    tdm_tokenizer_t *tok = load_vocab(name);
    char *s = english_text(10 * 1024);
    size_t n = strlen(s);
    double best = 1e9;
    size_t n_ids = 0;
    for (int it = 0; it < 5; it++) {
        tdm_token_t *ids;
        double t0 = tdm_time_now();
        encode_ok(tok, s, n, false, false, &ids, &n_ids);
        double dt = tdm_time_now() - t0;
        best = dt < best ? dt : best;
        free(ids);
    }
    printf("%s: encoding %zu bytes of English: %.3f ms (%zu tokens)\n", name, n, best * 1e3, n_ids);
#ifndef TDM_TEST_SANITIZED
    assert_true(best < 0.010);
#endif
    free(s);

    /* Long runs are one pre-token each: the merge loop must stay O(n log n). */
    size_t big = 256 * 1024;
    s = malloc(big);
    assert_non_null(s);
    const char *fill[] = {"a", " ", "ab", "\xe4\xbd\xa0"};
    for (size_t f = 0; f < sizeof fill / sizeof fill[0]; f++) {
        size_t lf = strlen(fill[f]), k = 0;
        while (k + lf <= big) {
            memcpy(s + k, fill[f], lf);
            k += lf;
        }
        double t0 = tdm_time_now();
        check_round_trip(tok, s, k, "long run");
        double dt = tdm_time_now() - t0;
        printf("%s: round trip of %zu bytes of '%s'...: %.1f ms\n", name, k, fill[f], dt * 1e3);
        assert_true(dt < 5.0);
    }
    free(s);
    tdm_tokenizer_destroy(&tok);
}

int main(void)
{
    static vocab_state_t vocabs[] = {
        {"gpt-2", false},  {"starcoder", false}, {"deepseek-coder", false},
        {"falcon", false}, {"llama-spm", false}, {"deepseek-llm", true},
        {"mpt", true},     {"command-r", true},
    };
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_prestate(test_vectors, &vocabs[0]),
        cmocka_unit_test_prestate(test_vectors, &vocabs[1]),
        cmocka_unit_test_prestate(test_vectors, &vocabs[2]),
        cmocka_unit_test_prestate(test_vectors, &vocabs[3]),
        cmocka_unit_test_prestate(test_vectors, &vocabs[4]),
        cmocka_unit_test_prestate(test_vectors, &vocabs[5]),
        cmocka_unit_test_prestate(test_vectors, &vocabs[6]),
        cmocka_unit_test_prestate(test_vectors, &vocabs[7]),
        cmocka_unit_test_prestate(test_refused_architecture, &vocabs[6]),
        cmocka_unit_test_prestate(test_refused_architecture, &vocabs[7]),
        cmocka_unit_test_prestate(test_random_round_trip, &vocabs[0]),
        cmocka_unit_test_prestate(test_random_round_trip, &vocabs[1]),
        cmocka_unit_test_prestate(test_random_round_trip, &vocabs[2]),
        cmocka_unit_test_prestate(test_random_round_trip, &vocabs[3]),
        cmocka_unit_test_prestate(test_random_round_trip, &vocabs[4]),
        cmocka_unit_test(test_detok_split_chars),
        cmocka_unit_test(test_spm_space_prefix),
        cmocka_unit_test(test_special_tokens),
        cmocka_unit_test(test_metadata_errors),
        cmocka_unit_test(test_pre_tokenizers),
        cmocka_unit_test_prestate(test_speed, &vocabs[1]),
        cmocka_unit_test_prestate(test_speed, &vocabs[4]),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
