//! A doubly linked list over a slab: the LRU order of the index's predicted entries and of
//! its event-backed entries under a memory bound.

/// A doubly linked list over a slab: O(1) push to the back, unlink and move to the back by
/// slot, the least recent item at the front.
#[derive(Clone, Debug)]
pub(super) struct LruList<T> {
    nodes: Vec<LruNode<T>>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
}

#[derive(Clone, Debug)]
struct LruNode<T> {
    item: T,
    prev: u32,
    next: u32,
}

const NIL: u32 = u32::MAX;

impl<T: Copy> LruList<T> {
    pub(super) fn new() -> Self {
        Self {
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    /// Items in the list.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn push_back(&mut self, item: T) -> u32 {
        let node = LruNode {
            item,
            prev: self.tail,
            next: NIL,
        };
        let slot = match self.free.pop() {
            Some(s) => {
                self.nodes[s as usize] = node;
                s
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        if self.tail != NIL {
            self.nodes[self.tail as usize].next = slot;
        } else {
            self.head = slot;
        }
        self.tail = slot;
        self.len += 1;
        slot
    }

    fn detach(&mut self, slot: u32) {
        let (prev, next) = {
            let n = &self.nodes[slot as usize];
            (n.prev, n.next)
        };
        if prev != NIL {
            self.nodes[prev as usize].next = next;
        } else {
            self.head = next;
        }
        if next != NIL {
            self.nodes[next as usize].prev = prev;
        } else {
            self.tail = prev;
        }
    }

    pub(super) fn remove(&mut self, slot: u32) -> T {
        self.detach(slot);
        self.free.push(slot);
        self.len -= 1;
        self.nodes[slot as usize].item
    }

    pub(super) fn move_to_back(&mut self, slot: u32) {
        if self.tail == slot {
            return;
        }
        self.detach(slot);
        let n = &mut self.nodes[slot as usize];
        n.prev = self.tail;
        n.next = NIL;
        self.nodes[self.tail as usize].next = slot;
        self.tail = slot;
    }

    pub(super) fn get(&self, slot: u32) -> &T {
        &self.nodes[slot as usize].item
    }

    pub(super) fn get_mut(&mut self, slot: u32) -> &mut T {
        &mut self.nodes[slot as usize].item
    }

    pub(super) fn front(&self) -> Option<u32> {
        (self.head != NIL).then_some(self.head)
    }

    pub(super) fn clear(&mut self) {
        self.nodes.clear();
        self.free.clear();
        self.head = NIL;
        self.tail = NIL;
        self.len = 0;
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = T> + '_ {
        let mut at = self.head;
        std::iter::from_fn(move || {
            if at == NIL {
                return None;
            }
            let n = &self.nodes[at as usize];
            at = n.next;
            Some(n.item)
        })
    }
}
