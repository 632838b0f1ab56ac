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

/* Total and free memory (what a node's budget is checked against) and the UUID (what the
 * router's transport choice compares) of every device. */
static void test_device_memory_uuid(void **state)
{
    (void)state;
    int n = 0;
    tdm_error_t err = {0};
    assert_int_equal(tdm_device_cuda_count(&n, &err), TDM_OK);
    for (int i = 0; i < n; i++) {
        uint64_t total = 0, free_b = 0;
        assert_int_equal(tdm_device_cuda_memory(i, &total, &free_b, &err), TDM_OK);
        tdm_device_info_t info;
        assert_int_equal(tdm_device_cuda_info(i, &info, &err), TDM_OK);
        assert_int_equal(total, info.total_mem_bytes);
        assert_true(free_b > 0 && free_b <= total);
        char uuid[TDM_DEVICE_UUID_MAX];
        assert_int_equal(tdm_device_cuda_uuid(i, uuid, &err), TDM_OK);
        assert_int_equal(strlen(uuid), 40);
        assert_true(strncmp(uuid, "GPU-", 4) == 0);
        printf("cuda:%d %s total %llu free %llu bytes\n", i, uuid, (unsigned long long)total,
               (unsigned long long)free_b);
    }
    uint64_t total, free_b;
    assert_int_equal(tdm_device_cuda_memory(n, &total, &free_b, &err), TDM_EINVALID);
}

int main(void)
{
    int n = 0;
    tdm_error_t err = {0};
    if (tdm_device_cuda_count(&n, &err) != TDM_OK || n == 0) {
        printf("SKIP: no usable CUDA device: %s\n", n == 0 && !err.msg[0] ? "0 devices" : err.msg);
        return 77;
    }
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_device_properties),
                                       cmocka_unit_test(test_device_memory_uuid)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
