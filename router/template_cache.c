/* template_cache.c - compiled request chat templates, looked up by hash (template_cache.h). */
#include "template_cache.h"

#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "tandem/chat.h"

/* Frees one slot's contents and marks it free. */
static void slot_clear(rt_template_entry_t *e)
{
    free(e->src);
    tdm_jinja_destroy(&e->t);
    memset(e, 0, sizeof *e);
}

const tdm_jinja_t *rt_template_cache_get(rt_template_cache_t *c, const char *src, size_t len,
                                         tdm_error_t *err)
{
    uint64_t h = XXH3_64bits(src, len);
    c->clock++;
    rt_template_entry_t *victim = NULL; /* the first free slot, else the least recent */
    for (size_t i = 0; i < RT_TEMPLATE_CACHE_SIZE; i++) {
        rt_template_entry_t *e = &c->slot[i];
        if (e->src && e->hash == h && e->len == len && memcmp(e->src, src, len) == 0) {
            e->used = c->clock;
            return e->t;
        }
        if (!victim || (victim->src && (!e->src || e->used < victim->used)))
            victim = e;
    }
    tdm_jinja_t *t = tdm_chat_jinja_compile(src, len, err);
    if (!t)
        return NULL;
    char *copy = malloc(len ? len : 1);
    if (!copy) {
        tdm_jinja_destroy(&t);
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    memcpy(copy, src, len);
    slot_clear(victim);
    *victim = (rt_template_entry_t){.hash = h, .src = copy, .len = len, .t = t, .used = c->clock};
    c->compiles++;
    return t;
}

void rt_template_cache_fini(rt_template_cache_t *c)
{
    for (size_t i = 0; c && i < RT_TEMPLATE_CACHE_SIZE; i++)
        slot_clear(&c->slot[i]);
}
