/* json_schema_format.c - JSON Schema's `format`s as regexes (regex.c's subset, anchored), for
 * the automaton (regex_dfa.c): the formats with no GBNF form of their own (uri-reference, iri,
 * iri-reference, uri-template, json-pointer, relative-json-pointer, draft 3's host-name and
 * ip-address), and every format beside `pattern`, `minLength` or `maxLength` (the automaton
 * intersects them exactly). Each regex is the definition's grammar written out (RFC 3986 for
 * URIs, RFC 3987 for IRIs, RFC 6570 for URI templates, RFC 6901 and the relative JSON pointer
 * draft for pointers), and the ones with a GBNF form in json_schema_string.c match the same
 * strings as it does.
 */
#include <stdio.h>
#include <string.h>

#include "json_schema_internal.h"
#include "regex_internal.h"

#define HEX "[0-9a-fA-F]"
#define RX_LABEL "[a-zA-Z0-9](?:[a-zA-Z0-9\\-]{0,61}[a-zA-Z0-9])?"
#define RX_HOSTNAME RX_LABEL "(?:\\." RX_LABEL ")*"
#define RX_OCTET "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9][0-9]|[0-9])"
#define RX_IPV4 RX_OCTET "\\." RX_OCTET "\\." RX_OCTET "\\." RX_OCTET
#define RX_H16 HEX "{1,4}"
#define RX_H16C "(?:" RX_H16 ":)"
#define RX_LS32 "(?:" RX_H16 ":" RX_H16 "|" RX_IPV4 ")"
#define RX_IPV6                                                                                    \
    "(?:" RX_H16C "{6}" RX_LS32 "|::" RX_H16C "{5}" RX_LS32 "|(?:" RX_H16 ")?::" RX_H16C           \
    "{4}" RX_LS32 "|(?:" RX_H16C "{0,1}" RX_H16 ")?::" RX_H16C "{3}" RX_LS32 "|(?:" RX_H16C        \
    "{0,2}" RX_H16 ")?::" RX_H16C "{2}" RX_LS32 "|(?:" RX_H16C "{0,3}" RX_H16                      \
    ")?::" RX_H16C RX_LS32 "|(?:" RX_H16C "{0,4}" RX_H16 ")?::" RX_LS32 "|(?:" RX_H16C             \
    "{0,5}" RX_H16 ")?::" RX_H16 "|(?:" RX_H16C "{0,6}" RX_H16 ")?::)"
#define RX_D31 "(?:0[1-9]|[12][0-9]|3[01])"
#define RX_D30 "(?:0[1-9]|[12][0-9]|30)"
#define RX_D28 "(?:0[1-9]|1[0-9]|2[0-8])"
#define RX_LEAP "(?:[0-9]{2}(?:[02468][48]|[13579][26]|[2468]0)|(?:[02468][048]|[13579][26])00)"
#define RX_DATE                                                                                    \
    "(?:[0-9]{4}-(?:(?:0[13578]|1[02])-" RX_D31 "|(?:0[469]|11)-" RX_D30 "|02-" RX_D28             \
    ")|" RX_LEAP "-02-29)"
#define RX_TIME                                                                                    \
    "(?:(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]+)?(?:[zZ]|[+\\-](?:[01][0-9]|"       \
    "2[0-3]):[0-5][0-9])|23:59:60(?:\\.[0-9]+)?(?:[zZ]|[+\\-]00:00))"
#define RX_DUR_TIME "T(?:[0-9]+H(?:[0-9]+M(?:[0-9]+S)?)?|[0-9]+M(?:[0-9]+S)?|[0-9]+S)"
#define RX_DURATION                                                                                \
    "P(?:(?:[0-9]+Y(?:[0-9]+M(?:[0-9]+D)?)?|[0-9]+M(?:[0-9]+D)?|[0-9]+D)(?:" RX_DUR_TIME           \
    ")?|" RX_DUR_TIME "|[0-9]+W)"
#define RX_ATEXT "[a-zA-Z0-9!#$%&'*+/=?^_`{|}~\\-]"
#define RX_POINTER "(?:/(?:[^/~]|~[01])*)*"

static const struct {
    const char *name, *rx;
} k_format_rx[] = {
    {"date", RX_DATE},
    {"time", RX_TIME},
    {"date-time", RX_DATE "[Tt]" RX_TIME},
    {"uuid", HEX "{8}-" HEX "{4}-" HEX "{4}-" HEX "{4}-" HEX "{12}"},
    {"email", RX_ATEXT "+(?:\\." RX_ATEXT "+)*@" RX_HOSTNAME},
    {"uri", "[a-zA-Z][a-zA-Z0-9+.\\-]*:[^\\x00-\\x20\"\\\\<>{}|^`\\x7F]*"},
    {"hostname", RX_HOSTNAME},
    {"host-name", RX_HOSTNAME},
    {"ipv4", RX_IPV4},
    {"ip-address", RX_IPV4},
    {"ipv6", RX_IPV6},
    {"duration", RX_DURATION},
    {"json-pointer", RX_POINTER},
    {"relative-json-pointer", "(?:0|[1-9][0-9]*)(?:#|" RX_POINTER ")"},
};

/* RFC 3986 section 3 (URI, relative-ref), or with iri RFC 3987 section 2.2 (IRI, irelative-ref:
 * unreserved widened by ucschar, the query by iprivate), appended to b; absolute: the URI / IRI
 * rule alone, else the -reference rule (either). ucs holds the extra class members (UTF-8). */
static void uri_rx(tdm_buf_t *b, bool absolute, const char *ucs, const char *priv)
{
    char unres[512], pchar[1024], seg[1200];
    snprintf(unres, sizeof unres, "A-Za-z0-9._~\\-%s", ucs);
    snprintf(pchar, sizeof pchar, "(?:[%s!$&'()*+,;=:@]|%%" HEX "{2})", unres);
    snprintf(seg, sizeof seg, "(?:/%s*)*", pchar);
    tdm_buf_t auth = TDM_BUF_INIT, tail = TDM_BUF_INIT;
    tdm_buf_printf(&auth,
                   "//(?:(?:[%s!$&'()*+,;=:]|%%" HEX "{2})*@)?(?:\\[(?:" RX_IPV6 "|v" HEX
                   "+\\.[A-Za-z0-9._~\\-!$&'()*+,;=:]+)\\]|(?:[%s!$&'()*+,;=]|%%" HEX
                   "{2})*)(?::[0-9]*)?%s",
                   unres, unres, seg);
    tdm_buf_printf(&tail, "(?:\\?(?:%s|[/?%s])*)?(?:#(?:%s|[/?])*)?", pchar, priv, pchar);
    const char *a = auth.data ? auth.data : "", *t = tail.data ? tail.data : "";
    /* hier-part / relative-part: authority, absolute path, rootless / no-scheme path, empty */
    tdm_buf_printf(b, "(?:[A-Za-z][A-Za-z0-9+.\\-]*:(?:%s|/(?:%s+%s)?|%s+%s|)%s", a, pchar, seg,
                   pchar, seg, t);
    if (!absolute)
        tdm_buf_printf(b, "|(?:%s|/(?:%s+%s)?|(?:[%s!$&'()*+,;=@]|%%" HEX "{2})+%s|)%s", a, pchar,
                       seg, unres, seg, t);
    tdm_buf_puts(b, ")");
    if (auth.oom || tail.oom)
        b->oom = true;
    tdm_buf_free(&auth);
    tdm_buf_free(&tail);
}

static void put_cp(char **p, uint32_t cp)
{
    unsigned char *q = (unsigned char *)*p;
    if (cp < 0x800) {
        *q++ = (unsigned char)(0xC0 | (cp >> 6));
    } else if (cp < 0x10000) {
        *q++ = (unsigned char)(0xE0 | (cp >> 12));
        *q++ = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    } else {
        *q++ = (unsigned char)(0xF0 | (cp >> 18));
        *q++ = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
        *q++ = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    }
    *q++ = (unsigned char)(0x80 | (cp & 0x3F));
    *p = (char *)q;
}

/* Class members for the ranges lo[i]..hi[i] (code points from U+0080), UTF-8. */
static void ranges(char *out, const uint32_t (*r)[2], size_t n)
{
    for (size_t i = 0; i < n; i++) {
        put_cp(&out, r[i][0]);
        *out++ = '-';
        put_cp(&out, r[i][1]);
    }
    *out = 0;
}

/* RFC 3987's ucschar and iprivate. */
static void iri_classes(char *ucs, char *priv)
{
    uint32_t u[17][2] = {{0xA0, 0xD7FF}, {0xF900, 0xFDCF}, {0xFDF0, 0xFFEF}};
    for (uint32_t p = 1; p <= 14; p++) {
        u[2 + p][0] = p == 14 ? 0xE1000 : p << 16;
        u[2 + p][1] = (p << 16) | 0xFFFD;
    }
    static const uint32_t v[3][2] = {{0xE000, 0xF8FF}, {0xF0000, 0xFFFFD}, {0x100000, 0x10FFFD}};
    ranges(ucs, (const uint32_t(*)[2])u, 17);
    ranges(priv, v, 3);
}

/* RFC 6570 section 2 (level 4): literals and expressions. */
static void template_rx(tdm_buf_t *b, const char *ucs, const char *priv)
{
    const char *var = "(?:[A-Za-z0-9_]|%" HEX "{2})";
    tdm_buf_printf(b,
                   "(?:[!#$&()*+,\\-./0-9:;=?@A-Z\\[\\]_a-z~%s%s]|%%" HEX "{2}|\\{[+#./;?&=,!@|]?"
                   "%s(?:\\.?%s)*(?::[1-9][0-9]{0,3}|\\*)?(?:,%s(?:\\.?%s)*(?::[1-9][0-9]{0,3}|"
                   "\\*)?)*\\})*",
                   ucs, priv, var, var, var, var);
}

int js_format_regex(const char *name, tdm_buf_t *out)
{
    for (size_t i = 0; i < sizeof k_format_rx / sizeof k_format_rx[0]; i++) {
        if (strcmp(k_format_rx[i].name, name) == 0) {
            tdm_buf_printf(out, "^(?:%s)$", k_format_rx[i].rx);
            return out->oom ? TDM_ERESOURCE : 0;
        }
    }
    char ucs[17 * 9 + 1], priv[3 * 9 + 1];
    iri_classes(ucs, priv);
    bool iri = strncmp(name, "iri", 3) == 0;
    tdm_buf_puts(out, "^");
    if (strcmp(name, "uri-reference") == 0 || strcmp(name, "iri") == 0 ||
        strcmp(name, "iri-reference") == 0)
        uri_rx(out, strcmp(name, "iri") == 0, iri ? ucs : "", iri ? priv : "");
    else if (strcmp(name, "uri-template") == 0)
        template_rx(out, ucs, priv);
    else
        return TDM_ENOTFOUND;
    tdm_buf_puts(out, "$");
    return out->oom ? TDM_ERESOURCE : 0;
}
