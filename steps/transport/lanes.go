package transport

import (
	"fmt"
	"hash/fnv"
	"strconv"
)

// Lanes spreads one logical topic over Count physical topics. A consumer
// group on one topic is a single serial lane; n lanes give n of them. All
// messages with the same key (a saga id) go to the same lane, so per-key
// order holds.
//
// With Count 0 or 1 the logical topic is used as is; otherwise lane i is
// "<Topic>.<i>". Changing Count moves keys between lanes: drain the old lanes
// first.
type Lanes struct {
	Topic string
	Count int
}

// Validate checks that every lane name is a valid topic.
func (l Lanes) Validate() error {
	if l.Count < 0 {
		return fmt.Errorf("transport: lanes of %s: count must not be negative, got %d", l.Topic, l.Count)
	}
	return ValidateTopic(l.Name(max(l.Count, 1) - 1))
}

// Of returns the lane of key: a stable FNV-1a hash of key modulo Count.
func (l Lanes) Of(key string) int {
	if l.Count <= 1 {
		return 0
	}
	h := fnv.New32a()
	h.Write([]byte(key))
	return int(h.Sum32() % uint32(l.Count))
}

// For returns the topic of key's lane.
func (l Lanes) For(key string) string { return l.Name(l.Of(key)) }

// Name returns the topic of lane i.
func (l Lanes) Name(i int) string {
	if l.Count <= 1 {
		return l.Topic
	}
	return l.Topic + "." + strconv.Itoa(i)
}

// All returns the topics of every lane.
func (l Lanes) All() []string {
	n := max(l.Count, 1)
	out := make([]string, n)
	for i := range out {
		out[i] = l.Name(i)
	}
	return out
}
