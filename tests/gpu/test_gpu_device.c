/* test_gpu_device.c - the CUDA runtime sees a device and reports sane properties.
 * Skips (exit 77) with the reason when the build has no CUDA backend or no GPU is present. */
#include <stdio.h>
#include <string.h>

#include "tdm_test.h"
#include "tandem/device.h"

static void test_device_properties(void **state)
{
    (void)state;
    int n = 0;
    tdm_error_t err = {0};
    assert_int_equal(tdm_device_cuda_count(&n, &err), TDM_OK);
    assert_true(n >= 1);
    for (int i = 0; i < n; i++) {
        tdm_device_info_t info;
        assert_int_equal(tdm_device_cuda_info(i, &info, &err), TDM_OK);
        assert_int_equal(info.index, i);
        assert_true(strlen(info.name) > 0);
        assert_true(info.cc_major >= 7);
        assert_true(info.total_mem_bytes >= (1ull << 30));
        assert_true(info.n_sms > 0);
        printf("cuda:%d %s cc %d.%d %llu bytes %d SMs\n", i, info.name, info.cc_major,
               info.cc_minor, (unsigned long long)info.total_mem_bytes, info.n_sms);
    }
    tdm_device_info_t info;
    assert_int_equal(tdm_device_cuda_info(n, &info, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "does not exist"));
}

int main(void)
{
    int n = 0;
    tdm_error_t err = {0};
    if (tdm_device_cuda_count(&n, &err) != TDM_OK || n == 0) {
        printf("SKIP: no usable CUDA device: %s\n", n == 0 && !err.msg[0] ? "0 devices" : err.msg);
        return 77;
    }
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_device_properties)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
