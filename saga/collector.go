package saga

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/pgsaga/pgsaga/internal/telemetry"
	"github.com/pgsaga/pgsaga/internal/transport"
)

// collectTimeout bounds the queries of one scrape of a
// Client.Collector.
const collectTimeout = 5 * time.Second

// inFlightSQL counts the instances that are not finished, and the parked
// ones, by saga and status (saga_instances_status_idx serves it).
const inFlightSQL = `SELECT saga_type, status, count(*) FROM saga_instances
WHERE status IN ('running', 'compensating', 'failed') GROUP BY saga_type, status`

var (
	inFlightDesc = prometheus.NewDesc(telemetry.Namespace+"_sagas_in_flight",
		"Saga instances running or compensating now, by saga and status (read from the database at scrape time).",
		[]string{"saga", "status"}, nil)
	parkedDesc = prometheus.NewDesc(telemetry.Namespace+"_sagas_parked",
		"Saga instances parked as failed, waiting for an operator (read from the database at scrape time).",
		[]string{"saga"}, nil)
	depthDesc = prometheus.NewDesc(telemetry.Namespace+"_consumer_depth",
		"Messages waiting in a consumer group's queue, those retrying or not yet available included.",
		[]string{"topic", "consumer_group"}, nil)
	retryingDesc = prometheus.NewDesc(telemetry.Namespace+"_consumer_retrying",
		"Messages of a consumer group's queue that failed before and wait for another attempt.",
		[]string{"topic", "consumer_group"}, nil)
	oldestDesc = prometheus.NewDesc(telemetry.Namespace+"_consumer_oldest_age_seconds",
		"Age of the oldest message waiting in a consumer group's queue (0 when none waits).",
		[]string{"topic", "consumer_group"}, nil)
	lastSeenDesc = prometheus.NewDesc(telemetry.Namespace+"_consumer_last_seen_age_seconds",
		"Time since a running router last showed the consumer group alive (absent for a group no router ever ran).",
		[]string{"topic", "consumer_group"}, nil)
	deadWaitingDesc = prometheus.NewDesc(telemetry.Namespace+"_dead_letters_waiting",
		"Dead letters not replayed, by topic (read from the database at scrape time).",
		[]string{"topic"}, nil)
	upDesc = prometheus.NewDesc(telemetry.Namespace+"_database_up",
		"1 if the last scrape read everything it reads from the database, 0 if a query failed (the values it could not read are missing).",
		nil, nil)
)

// collector exports what the database holds, read at every scrape: sagas
// in flight and parked, each consumer group's depth and the age of its
// oldest message, and dead letters not replayed. Every process reading one
// database reports the same values: aggregate them with max, not sum, or
// register the collector in one process. A query that fails (the database
// is down, or slower than collectTimeout) leaves its values out,
// rather than report stale ones, sets pgsaga_database_up to 0 and is
// logged; the scrape goes on, so the process's own metrics are served.
type collector struct {
	tr      *transport.Transport
	timeout time.Duration
	// registered lists the sagas the client registered: each reads 0
	// when none of its instances is in that state (nil: none).
	registered func() []string
}

var _ prometheus.Collector = (*collector)(nil)

// newCollector returns a collector of the database tr delivers through;
// the sagas registered lists read 0 rather than go missing.
func newCollector(tr *transport.Transport, registered func() []string) *collector {
	return &collector{tr: tr, timeout: collectTimeout, registered: registered}
}

// Collector returns a Prometheus collector of what the client's database
// holds, read at every scrape: sagas in flight and parked, each consumer
// group's depth and the age of its oldest message, and dead letters not
// replayed. Every process reading one database reports the same values:
// aggregate them with max, not sum, or register the collector in one
// process. A query that fails (the database is down, or slower than
// collectTimeout) leaves its values out, rather than report stale
// ones, sets pgsaga_database_up to 0 and is logged; the scrape goes on, so
// the process's own metrics are served. The client need not be started.
func (c *Client) Collector() prometheus.Collector { return newCollector(c.transport, c.engine.names) }

// Describe implements prometheus.Collector.
func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{inFlightDesc, parkedDesc, depthDesc, retryingDesc, oldestDesc, lastSeenDesc, deadWaitingDesc, upDesc} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *collector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	var errs []error
	defer func() {
		up := 1.0
		if err := errors.Join(errs...); err != nil {
			up = 0
			c.tr.Config().Logger.Warn("saga: reading metrics from the database", "err", err)
		}
		ch <- prometheus.MustNewConstMetric(upDesc, prometheus.GaugeValue, up)
	}()
	if err := c.collectSagas(ctx, ch); err != nil {
		errs = append(errs, fmt.Errorf("sagas in flight: %w", err))
	}
	groups, err := c.tr.ConsumerGroups(ctx)
	if err != nil {
		errs = append(errs, err)
	}
	for _, g := range groups {
		ch <- prometheus.MustNewConstMetric(depthDesc, prometheus.GaugeValue, float64(g.Waiting), g.Topic, g.ConsumerGroup)
		ch <- prometheus.MustNewConstMetric(retryingDesc, prometheus.GaugeValue, float64(g.Retrying), g.Topic, g.ConsumerGroup)
		age := 0.0
		if g.Oldest != nil {
			age = max(0, g.ReadAt.Sub(*g.Oldest).Seconds())
		}
		ch <- prometheus.MustNewConstMetric(oldestDesc, prometheus.GaugeValue, age, g.Topic, g.ConsumerGroup)
		if g.LastSeen != nil {
			ch <- prometheus.MustNewConstMetric(lastSeenDesc, prometheus.GaugeValue, max(0, g.ReadAt.Sub(*g.LastSeen).Seconds()), g.Topic, g.ConsumerGroup)
		}
	}
	dead, err := c.tr.DeadLettersWaiting(ctx)
	if err != nil {
		errs = append(errs, err)
	}
	for topic, n := range dead {
		ch <- prometheus.MustNewConstMetric(deadWaitingDesc, prometheus.GaugeValue, float64(n), topic)
	}
}

func (c *collector) collectSagas(ctx context.Context, ch chan<- prometheus.Metric) error {
	rows, err := c.tr.DB().QueryContext(ctx, inFlightSQL)
	if err != nil {
		return err
	}
	defer rows.Close()
	type key struct{ name, status string }
	counts := map[key]int64{}
	for rows.Next() {
		var (
			k key
			n int64
		)
		if err := rows.Scan(&k.name, &k.status, &n); err != nil {
			return err
		}
		counts[k] = n
	}
	if err := rows.Err(); err != nil {
		return err
	}
	if c.registered != nil {
		for _, name := range c.registered() {
			for _, st := range []Status{StatusRunning, StatusCompensating, StatusFailed} {
				if k := (key{name, string(st)}); counts[k] == 0 {
					counts[k] = 0 // a registered saga's gauges read 0, not nothing
				}
			}
		}
	}
	for k, n := range counts {
		if Status(k.status) == StatusFailed {
			ch <- prometheus.MustNewConstMetric(parkedDesc, prometheus.GaugeValue, float64(n), k.name)
			continue
		}
		ch <- prometheus.MustNewConstMetric(inFlightDesc, prometheus.GaugeValue, float64(n), k.name, k.status)
	}
	return nil
}
