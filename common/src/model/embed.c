/* embed.c - pooling a prompt's final hidden states into an L2-normalised embedding (model.h).
 *
 * Accumulation is in double and in position order, so the result depends only on the rows,
 * never on how the prompt was chunked or what else shared its forward passes. */
#include <math.h>
#include <string.h>

#include "tandem/model.h"

const char *tdm_pooling_name(tdm_pooling_t p)
{
    switch (p) {
    case TDM_POOLING_LAST: return "last";
    case TDM_POOLING_MEAN: return "mean";
    }
    return "?";
}

int tdm_pooling_parse(const char *name, tdm_pooling_t *out)
{
    if (strcmp(name, "last") == 0)
        *out = TDM_POOLING_LAST;
    else if (strcmp(name, "mean") == 0)
        *out = TDM_POOLING_MEAN;
    else
        return TDM_EINVALID;
    return TDM_OK;
}

void tdm_embedding_add(tdm_pooling_t p, double *acc, const float *row, uint32_t n_embd)
{
    if (p == TDM_POOLING_MEAN)
        for (uint32_t i = 0; i < n_embd; i++)
            acc[i] += (double)row[i];
    else
        for (uint32_t i = 0; i < n_embd; i++)
            acc[i] = (double)row[i];
}

void tdm_embedding_finish(tdm_pooling_t p, const double *acc, uint32_t n_rows, uint32_t n_embd,
                          float *out)
{
    double scale = p == TDM_POOLING_MEAN && n_rows > 0 ? 1.0 / (double)n_rows : 1.0;
    double ss = 0.0;
    for (uint32_t i = 0; i < n_embd; i++) {
        double v = acc[i] * scale;
        ss += v * v;
    }
    double inv = ss > 0.0 ? scale / sqrt(ss) : 0.0;
    for (uint32_t i = 0; i < n_embd; i++)
        out[i] = (float)(acc[i] * inv);
}
