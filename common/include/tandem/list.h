/* list.h - an intrusive circular doubly-linked list (the Linux kernel's list_head).
 *
 * The node is embedded in the object it links (`tdm_list_t link;`), so linking allocates
 * nothing and cannot fail, unlinking is O(1) from the object alone, and one object can be on
 * several lists through several nodes. The head is a node that belongs to no object; an empty
 * list's head points at itself. TDM_LIST_ENTRY (container_of) turns a node back into its
 * object. A node is "linked" while it is on a list: tdm_list_remove re-initialises it, so
 * removing twice is harmless and tdm_list_is_linked tells where it is.
 *
 * Header-only (static inline); compiles as C11 and as C++. Not thread-safe: a list belongs to
 * whoever owns its head.
 */
#ifndef TANDEM_LIST_H
#define TANDEM_LIST_H

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_list {
    struct tdm_list *prev, *next;
} tdm_list_t;

/* The object of type `type` whose member `member` is at ptr (the kernel's container_of; for
 * any embedded member, not only list nodes). */
#define TDM_CONTAINER_OF(ptr, type, member) ((type *)(void *)((char *)(ptr)-offsetof(type, member)))
/* The object of type `type` whose tdm_list_t member `member` is the node at ptr. */
#define TDM_LIST_ENTRY(ptr, type, member) TDM_CONTAINER_OF(ptr, type, member)

/* Iterates pos over the nodes of the list at head, first to last. pos may be removed (and its
 * object freed) in the body: tmp holds the next node. No other node may be removed. */
#define TDM_LIST_FOR_EACH_SAFE(pos, tmp, head)                                                     \
    for ((pos) = (head)->next, (tmp) = (pos)->next; (pos) != (head);                               \
         (pos) = (tmp), (tmp) = (pos)->next)

/* Makes an empty list (a head) or an unlinked node. Cannot fail. */
static inline void tdm_list_init(tdm_list_t *l)
{
    l->prev = l;
    l->next = l;
}

/* True when the list at head has no node. */
static inline bool tdm_list_is_empty(const tdm_list_t *head)
{
    return head->next == head;
}

/* True when node n (initialised) is on a list. */
static inline bool tdm_list_is_linked(const tdm_list_t *n)
{
    return n->next != n;
}

/* Links n (not on a list) between the adjacent nodes prev and next. */
static inline void tdm_list_link(tdm_list_t *n, tdm_list_t *prev, tdm_list_t *next)
{
    n->prev = prev;
    n->next = next;
    prev->next = n;
    next->prev = n;
}

/* Links n (not on a list) first / last on the list at head. Cannot fail. */
static inline void tdm_list_push_front(tdm_list_t *head, tdm_list_t *n)
{
    tdm_list_link(n, head, head->next);
}
static inline void tdm_list_push_back(tdm_list_t *head, tdm_list_t *n)
{
    tdm_list_link(n, head->prev, head);
}

/* Unlinks n from its list and leaves it initialised (unlinked); does nothing when n is not
 * linked. Cannot fail. */
static inline void tdm_list_remove(tdm_list_t *n)
{
    n->prev->next = n->next;
    n->next->prev = n->prev;
    tdm_list_init(n);
}

/* The first / last node of the list at head, or NULL when it is empty. */
static inline tdm_list_t *tdm_list_first(const tdm_list_t *head)
{
    return head->next == head ? NULL : head->next;
}
static inline tdm_list_t *tdm_list_last(const tdm_list_t *head)
{
    return head->prev == head ? NULL : head->prev;
}

/* The node after n on the list at head, or NULL when n is the last. */
static inline tdm_list_t *tdm_list_next(const tdm_list_t *head, const tdm_list_t *n)
{
    return n->next == head ? NULL : n->next;
}

/* Number of nodes on the list at head (walks it: O(n)). */
static inline size_t tdm_list_length(const tdm_list_t *head)
{
    size_t k = 0;
    for (const tdm_list_t *p = head->next; p != head; p = p->next)
        k++;
    return k;
}

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_LIST_H */
