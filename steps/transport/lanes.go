package transport

import (
	"fmt"
	"hash/fnv"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Lanes: one consumer group on one watermill-sql topic is a single serial
// lane, however many subscribers it has. A topic spread over n lanes is
// stored as n physical topics, "<topic>.0" … "<topic>.<n-1>"; a message goes
// to the lane of a stable hash of its lane key, so all messages of one key
// (one saga) stay in one lane, in order, and a Router handler reads every
// lane in parallel.

// MaxLanes bounds a topic's lane count.
const MaxLanes = 256

// MetaPartitionKey is the metadata that, when set, is a message's lane key
// (see Config.LaneKey). Event streams set it to the stream id, so one
// stream's events keep their order.
const MetaPartitionKey = "partition_key"

// DefaultDeadLetterTopic receives what the step runtime and the saga engine
// give up on. Dead-letter topics keep a single lane unless
// Config.TopicLanes says otherwise.
const DefaultDeadLetterTopic = "pgsaga_dead_letters"

// defaultLaneKey is MetaPartitionKey, else the saga id, else the UUID.
func defaultLaneKey(_ string, msg *message.Message) string {
	if k := msg.Metadata.Get(MetaPartitionKey); k != "" {
		return k
	}
	if k := msg.Metadata.Get("saga_id"); k != "" {
		return k
	}
	return msg.UUID
}

// LanesOf returns how many lanes topic is spread over.
func (t *Transport) LanesOf(topic string) int {
	if n, ok := t.cfg.TopicLanes[topic]; ok {
		return n
	}
	if topic == DefaultDeadLetterTopic || topic == t.cfg.Retry.DeadLetterTopic {
		return 1
	}
	return t.cfg.Lanes
}

// LaneTopics returns the physical topics of topic's lanes: topic itself when
// it has one lane.
func (t *Transport) LaneTopics(topic string) []string {
	return laneNames(topic, t.LanesOf(topic))
}

// LaneOf returns the physical topic msg goes to when published to topic.
func (t *Transport) LaneOf(topic string, msg *message.Message) string {
	n := t.LanesOf(topic)
	return laneName(topic, laneIndex(t.cfg.LaneKey(topic, msg), n), n)
}

// validateLanes checks that every lane of topic has a valid name.
func (t *Transport) validateLanes(topic string) error {
	if err := ValidateTopic(topic); err != nil {
		return err
	}
	n := t.LanesOf(topic)
	if err := ValidateTopic(laneName(topic, n-1, n)); err != nil {
		return fmt.Errorf("%w (with its %d lanes)", err, n)
	}
	return nil
}

// laneIndex is a stable FNV-1a hash of key modulo n.
func laneIndex(key string, n int) int {
	if n <= 1 {
		return 0
	}
	h := fnv.New32a()
	h.Write([]byte(key))
	return int(h.Sum32() % uint32(n))
}

func laneName(topic string, i, n int) string {
	if n <= 1 {
		return topic
	}
	return topic + "." + strconv.Itoa(i)
}

func laneNames(topic string, n int) []string {
	n = max(n, 1)
	out := make([]string, n)
	for i := range out {
		out[i] = laneName(topic, i, n)
	}
	return out
}
