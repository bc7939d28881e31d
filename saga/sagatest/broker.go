package sagatest

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/steps/broker"
)

// BrokerFaults says what to inject at the broker boundary, for sagas whose
// steps run in other services (steps/broker). Rates are probabilities from
// 0 to 1.
type BrokerFaults struct {
	// Seed makes the faults reproducible, as Faults.Seed.
	Seed uint64
	// RelayCrashRate is the share of publishes after which the relay dies
	// before its batch commits: the broker has the message, the database
	// still has it queued, and the relay publishes it again (the broker
	// deduplicates within its window). At most MaxRelayCrashes of them
	// (0: no limit).
	RelayCrashRate  float64
	MaxRelayCrashes int
	// RedeliverRate is the share of messages received from the broker that
	// are handed back (nack) after they were queued, so that the broker
	// delivers them again: a duplicate command or reply. A redelivery is not
	// handed back again.
	RedeliverRate float64
}

// BrokerStats counts what a BrokerInjector did.
type BrokerStats struct {
	Published    int // publishes the relay made (each try)
	RelayCrashes int
	Received     int // messages received and queued (each delivery)
	Distinct     int // of those, different messages (by topic and UUID)
	Redelivered  int // of those, handed back for redelivery
}

// BrokerInjector injects BrokerFaults: install it as broker.Config.Faults
// (saga.ClientConfig.Broker.Faults) of each service's bridge, one injector
// per bridge.
type BrokerInjector struct {
	cfg BrokerFaults

	mu    sync.Mutex
	seen  map[string]int // topic + message → times published or received
	stats BrokerStats
}

var _ broker.Faults = (*BrokerInjector)(nil)

// NewBrokerInjector validates f and returns an injector.
func NewBrokerInjector(f BrokerFaults) (*BrokerInjector, error) {
	for name, r := range map[string]float64{"RelayCrashRate": f.RelayCrashRate, "RedeliverRate": f.RedeliverRate} {
		if r < 0 || r > 1 || math.IsNaN(r) {
			return nil, fmt.Errorf("sagatest: %s must be between 0 and 1, got %v", name, r)
		}
	}
	if f.MaxRelayCrashes < 0 {
		return nil, errors.New("sagatest: MaxRelayCrashes must not be negative")
	}
	return &BrokerInjector{cfg: f, seen: map[string]int{}}, nil
}

// Stats returns what the injector did so far.
func (b *BrokerInjector) Stats() BrokerStats {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.stats
}

// CrashAfterPublish implements broker.Faults.
func (b *BrokerInjector) CrashAfterPublish(topic string, msg *message.Message) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	key := "publish\x00" + topic + "\x00" + msg.UUID
	b.seen[key]++
	b.stats.Published++
	if b.cfg.MaxRelayCrashes > 0 && b.stats.RelayCrashes >= b.cfg.MaxRelayCrashes {
		return false
	}
	if chance(b.cfg.Seed, "relay-crash", topic, msg.UUID, strconv.Itoa(b.seen[key])) < b.cfg.RelayCrashRate {
		b.stats.RelayCrashes++
		return true
	}
	return false
}

// RedeliverAfterStore implements broker.Faults.
func (b *BrokerInjector) RedeliverAfterStore(topic string, msg *message.Message) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	key := "receive\x00" + topic + "\x00" + msg.UUID
	b.seen[key]++
	b.stats.Received++
	if b.seen[key] == 1 {
		b.stats.Distinct++
	}
	if b.seen[key] == 1 && chance(b.cfg.Seed, "redeliver", topic, msg.UUID) < b.cfg.RedeliverRate {
		b.stats.Redelivered++
		return true
	}
	return false
}

// chance is a uniform number in [0, 1) decided by the seed and the parts.
func chance(seed uint64, parts ...string) float64 {
	h := sha256.New()
	var s [8]byte
	binary.BigEndian.PutUint64(s[:], seed)
	h.Write(s[:])
	for _, p := range parts {
		h.Write([]byte(p))
		h.Write([]byte{0})
	}
	return float64(binary.BigEndian.Uint64(h.Sum(nil)[:8])>>11) / (1 << 53)
}
