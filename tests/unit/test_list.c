/* test_list.c - the intrusive doubly-linked list (tandem/list.h). */
#include <stdlib.h>
#include <string.h>

#include "tandem/list.h"
#include "tdm_test.h"

typedef struct item {
    int value;
    tdm_list_t link;  /* on the test's list */
    tdm_list_t other; /* a second list, to show one object on two */
} item_t;

/* The values of the list at head, first to last, into out (at most cap); returns the count. */
static size_t values(const tdm_list_t *head, int *out, size_t cap)
{
    size_t k = 0;
    for (tdm_list_t *p = tdm_list_first(head); p && k < cap; p = tdm_list_next(head, p))
        out[k++] = TDM_LIST_ENTRY(p, item_t, link)->value;
    return k;
}

static void test_push_and_order(void **state)
{
    (void)state;
    tdm_list_t head;
    tdm_list_init(&head);
    assert_true(tdm_list_is_empty(&head));
    assert_null(tdm_list_first(&head));
    assert_null(tdm_list_last(&head));
    assert_int_equal(tdm_list_length(&head), 0);
    item_t it[4];
    for (int i = 0; i < 4; i++) {
        it[i].value = i;
        tdm_list_init(&it[i].link);
        assert_false(tdm_list_is_linked(&it[i].link));
    }
    tdm_list_push_back(&head, &it[1].link);
    tdm_list_push_back(&head, &it[2].link);
    tdm_list_push_front(&head, &it[0].link);
    tdm_list_push_back(&head, &it[3].link);
    int v[8];
    assert_int_equal(values(&head, v, 8), 4);
    for (int i = 0; i < 4; i++)
        assert_int_equal(v[i], i);
    assert_ptr_equal(tdm_list_first(&head), &it[0].link);
    assert_ptr_equal(tdm_list_last(&head), &it[3].link);
    assert_null(tdm_list_next(&head, &it[3].link));
    assert_true(tdm_list_is_linked(&it[2].link));
    assert_ptr_equal(TDM_LIST_ENTRY(&it[2].link, item_t, link), &it[2]);
    assert_int_equal(tdm_list_length(&head), 4);
}

static void test_remove(void **state)
{
    (void)state;
    tdm_list_t head;
    tdm_list_init(&head);
    item_t it[3];
    for (int i = 0; i < 3; i++) {
        it[i].value = 10 + i;
        tdm_list_init(&it[i].link);
        tdm_list_push_back(&head, &it[i].link);
    }
    tdm_list_remove(&it[1].link);
    assert_false(tdm_list_is_linked(&it[1].link));
    tdm_list_remove(&it[1].link); /* twice: harmless */
    int v[4];
    assert_int_equal(values(&head, v, 4), 2);
    assert_int_equal(v[0], 10);
    assert_int_equal(v[1], 12);
    /* relinked at the front after being removed */
    tdm_list_push_front(&head, &it[1].link);
    assert_int_equal(values(&head, v, 4), 3);
    assert_int_equal(v[0], 11);
    tdm_list_remove(&it[0].link);
    tdm_list_remove(&it[1].link);
    tdm_list_remove(&it[2].link);
    assert_true(tdm_list_is_empty(&head));
}

/* The safe iteration may free the current object; one object can be on two lists at once. */
static void test_for_each_safe_and_two_lists(void **state)
{
    (void)state;
    tdm_list_t all, odd;
    tdm_list_init(&all);
    tdm_list_init(&odd);
    for (int i = 0; i < 10; i++) {
        item_t *it = calloc(1, sizeof *it);
        assert_non_null(it);
        it->value = i;
        tdm_list_push_back(&all, &it->link);
        tdm_list_init(&it->other);
        if (i % 2)
            tdm_list_push_back(&odd, &it->other);
    }
    assert_int_equal(tdm_list_length(&odd), 5);
    tdm_list_t *pos, *tmp;
    int seen = 0;
    TDM_LIST_FOR_EACH_SAFE(pos, tmp, &all)
    {
        item_t *it = TDM_LIST_ENTRY(pos, item_t, link);
        assert_int_equal(it->value, seen++);
        if (it->value % 3 == 0) { /* 0, 3, 6, 9 go */
            tdm_list_remove(&it->link);
            tdm_list_remove(&it->other);
            free(it);
        }
    }
    assert_int_equal(seen, 10);
    int v[10];
    assert_int_equal(values(&all, v, 10), 6);
    const int want[6] = {1, 2, 4, 5, 7, 8};
    for (int i = 0; i < 6; i++)
        assert_int_equal(v[i], want[i]);
    assert_int_equal(tdm_list_length(&odd), 3); /* 1, 5, 7 */
    int k = 0;
    const int want_odd[3] = {1, 5, 7};
    for (tdm_list_t *p = tdm_list_first(&odd); p; p = tdm_list_next(&odd, p))
        assert_int_equal(TDM_LIST_ENTRY(p, item_t, other)->value, want_odd[k++]);
    TDM_LIST_FOR_EACH_SAFE(pos, tmp, &all)
    {
        tdm_list_remove(pos);
        free(TDM_LIST_ENTRY(pos, item_t, link));
    }
    assert_true(tdm_list_is_empty(&all));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_push_and_order),
        cmocka_unit_test(test_remove),
        cmocka_unit_test(test_for_each_safe_and_two_lists),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
