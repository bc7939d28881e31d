package orderpayment_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/telemetry"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/payments"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
)

// records is a slog.Handler that keeps every record, for tests that read
// what was logged.
type records struct {
	mu  sync.Mutex
	all []slog.Record
}

func (r *records) Enabled(context.Context, slog.Level) bool { return true }
func (r *records) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.all = append(r.all, rec.Clone())
	return nil
}
func (r *records) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *records) WithGroup(string) slog.Handler      { return r }

// count counts Info records with message msg whose attribute key is value
// ("" key: any).
func (r *records) count(msg, key, value string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, rec := range r.all {
		if rec.Level != slog.LevelInfo || rec.Message != msg {
			continue
		}
		match := key == ""
		rec.Attrs(func(a slog.Attr) bool {
			if a.Key == key && a.Value.String() == value {
				match = true
			}
			return true
		})
		if match {
			n++
		}
	}
	return n
}

// scrape reads the metrics as a Prometheus server would: over HTTP, in the
// text format.
func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(string(body)))
	require.NoError(t, err, "%s", body)
	return fams
}

// value is the value of the series of family name with labels (a counter,
// a gauge, or a histogram's count), 0 if there is none.
func value(fams map[string]*dto.MetricFamily, name string, labels ...string) float64 {
	f := fams[name]
	if f == nil {
		return 0
	}
	var total float64
	for _, m := range f.GetMetric() {
		have := map[string]string{}
		for _, l := range m.GetLabel() {
			have[l.GetName()] = l.GetValue()
		}
		ok := true
		for i := 0; i+1 < len(labels); i += 2 {
			ok = ok && have[labels[i]] == labels[i+1]
		}
		if !ok {
			continue
		}
		switch {
		case m.Counter != nil:
			total += m.Counter.GetValue()
		case m.Gauge != nil:
			total += m.Gauge.GetValue()
		case m.Histogram != nil:
			total += float64(m.Histogram.GetSampleCount())
		}
	}
	return total
}

// histogramSum is the sum of the observations of a histogram series.
func histogramSum(fams map[string]*dto.MetricFamily, name string, labels ...string) float64 {
	var sum float64
	for _, m := range fams[name].GetMetric() {
		have := map[string]string{}
		for _, l := range m.GetLabel() {
			have[l.GetName()] = l.GetValue()
		}
		ok := true
		for i := 0; i+1 < len(labels); i += 2 {
			ok = ok && have[labels[i]] == labels[i+1]
		}
		if ok && m.Histogram != nil {
			sum += m.Histogram.GetSampleSum()
		}
	}
	return sum
}

// A real run of the sample with metrics on, scraped over HTTP: every
// counter matches what the database holds. Each charge fails its first
// attempt (so each is retried once), duplicates of finished charge
// commands arrive (answered from the store), and a malformed command is
// dead-lettered.
func TestMetricsMatchTheDatabase(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	logs := &records{}
	e := newEnv(t, 0, func(c *orderpayment.Config) {
		c.Transport.Metrics = reg
		c.Logger = slog.New(logs)
		c.Transport.Intercept = func(handler string, h transport.HandlerFunc) transport.HandlerFunc {
			if handler != "payments.charge" {
				return h
			}
			return func(msg *message.Message) error {
				if transport.AttemptFromContext(msg.Context()) == 1 {
					return errors.New("injected: the first attempt of every charge fails")
				}
				return h(msg)
			}
		}
	})
	reg.MustRegister(e.app.Client.Collector())
	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	t.Cleanup(srv.Close)

	// Record each charge command as queued, to send copies of it later.
	_, err := e.db.SQL.Exec(`
CREATE TABLE charge_log (uuid text, payload bytea, metadata jsonb);
CREATE FUNCTION log_charge() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.topic = 'payments.charge' THEN
        INSERT INTO charge_log VALUES (NEW.uuid, NEW.payload, NEW.metadata);
    END IF;
    RETURN NEW;
END$$;
CREATE TRIGGER log_charge AFTER INSERT ON pgsaga_queue FOR EACH ROW EXECUTE FUNCTION log_charge()`)
	require.NoError(t, err)

	rich, poor := e.customer(100_000), e.customer(500)
	var ids []uuid.UUID
	for i := range 6 {
		_, id := e.place(rich, int64(1_000+100*i))
		ids = append(ids, id)
	}
	for range 3 {
		_, id := e.place(poor, 2_000) // insufficient funds
		ids = append(ids, id)
	}
	cancelled, id := e.place(rich, 1_500)
	ids = append(ids, id)
	require.NoError(t, e.app.Orders.CancelByCustomer(context.Background(), cancelled, "changed my mind")) // refunded
	e.startWorker()
	for _, id := range ids {
		e.terminal(id)
	}
	e.checkInvariants(ids)

	// Duplicates of two finished charge commands, and one malformed one.
	const dups = 2
	_, err = e.db.SQL.Exec(`INSERT INTO pgsaga_queue (topic, consumer_group, uuid, payload, metadata)
SELECT 'payments.charge', 'payments.charge', uuid, payload, metadata FROM (SELECT DISTINCT ON (uuid) * FROM charge_log ORDER BY uuid LIMIT $1) c`, dups)
	require.NoError(t, err)
	tx, err := e.db.SQL.Begin()
	require.NoError(t, err)
	require.NoError(t, e.app.Client.PublishTx(context.Background(), tx, payments.ChargeTopic, message.NewMessage(uuid.NewString(), []byte("{not json"))))
	require.NoError(t, tx.Commit())
	e.drained()

	db := e.db.SQL
	count := func(query string, args ...any) float64 {
		var n int
		require.NoError(t, db.QueryRow(query, args...).Scan(&n))
		return float64(n)
	}
	// What is counted is counted just after its commit: scrape until the
	// last of it is in (every answered command, every retry and dead
	// letter), then compare everything.
	answered := count(`SELECT count(*) FROM idempotency_keys WHERE scope = ANY ($1) AND status <> 'pending'`, e.app.StepNames())
	var fams map[string]*dto.MetricFamily
	settled := func() bool {
		fams = scrape(t, srv.URL)
		return value(fams, "pgsaga_step_attempts") == answered &&
			value(fams, "pgsaga_sagas_finished_total") == float64(len(ids)) &&
			value(fams, "pgsaga_delivery_retries_total") >= float64(10+dups+1) &&
			value(fams, "pgsaga_dead_letters_total") == 1 &&
			value(fams, "pgsaga_idempotent_replays_total") == dups
	}
	deadline := time.Now().Add(10 * time.Second)
	for !settled() && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}

	// Sagas: started and finished by outcome, against saga_instances.
	assert.Equal(t, count(`SELECT count(*) FROM saga_instances`), value(fams, "pgsaga_sagas_started_total", "saga", orderpayment.Name))
	assert.Equal(t, float64(len(ids)), value(fams, "pgsaga_sagas_started_total"))
	for _, st := range []saga.Status{saga.StatusCompleted, saga.StatusCompensated, saga.StatusFailed} {
		assert.Equal(t, count(`SELECT count(*) FROM saga_instances WHERE status = $1`, st),
			value(fams, "pgsaga_sagas_finished_total", "saga", orderpayment.Name, "outcome", string(st)), "finished %s", st)
		assert.Equal(t, count(`SELECT count(*) FROM saga_instances WHERE status = $1`, st),
			float64(logs.count("saga "+string(st), "saga", orderpayment.Name)), "Info lines of sagas %s", st)
	}
	assert.Equal(t, float64(6), value(fams, "pgsaga_sagas_finished_total", "outcome", "completed"))
	assert.Equal(t, float64(4), value(fams, "pgsaga_sagas_finished_total", "outcome", "compensated"))
	assert.Equal(t, float64(len(ids)), float64(logs.count("saga started", "saga", orderpayment.Name)))
	assert.Zero(t, value(fams, "pgsaga_sagas_in_flight"), "every saga finished")

	// Steps: each answered command is a stored key, at the attempt it was
	// answered on.
	for _, step := range e.app.StepNames() {
		for _, outcome := range []string{telemetry.StepCompleted, telemetry.StepFailed} {
			keys := count(`SELECT count(*) FROM idempotency_keys WHERE scope = $1 AND status = $2`, step, outcome)
			assert.Equal(t, keys, value(fams, "pgsaga_step_duration_seconds", "step", step, "outcome", outcome), "%s %s", step, outcome)
			assert.Equal(t, keys, float64(logs.count("step "+outcome, "step", step)), "Info lines of %s %s", step, outcome)
		}
		answered := count(`SELECT count(*) FROM idempotency_keys WHERE scope = $1 AND status <> 'pending'`, step)
		assert.Equal(t, answered, value(fams, "pgsaga_step_attempts", "step", step), step)
	}
	charges := count(`SELECT count(*) FROM idempotency_keys WHERE scope = 'payments.charge'`)
	assert.Equal(t, float64(10), charges, "one charge a saga")
	// Every charge fails its first attempt; a loaded machine may add a
	// retry (a batch whose claim outlasted its transaction hands its
	// messages back: one charge in a full -count=3 run), counted in both.
	extra := histogramSum(fams, "pgsaga_step_attempts", "step", "payments.charge") - 2*charges
	assert.GreaterOrEqual(t, extra, float64(0), "every charge answered on its second attempt, or later")
	assert.Equal(t, float64(dups), value(fams, "pgsaga_idempotent_replays_total", "step", "payments.charge"))
	assert.Equal(t, float64(dups), value(fams, "pgsaga_step_duration_seconds", "step", "payments.charge", "outcome", telemetry.StepReplayed))
	assert.Equal(t, float64(dups), float64(logs.count("step replayed", "step", "payments.charge")))

	// Delivery: one retry per charge command (the duplicates and the
	// malformed one included: they fail their first attempt too), the dead
	// letter.
	assert.Equal(t, charges+dups+1, count(`SELECT count(*) FROM charge_log`), "charge messages queued")
	assert.Equal(t, charges+dups+1+extra, value(fams, "pgsaga_delivery_retries_total", "topic", payments.ChargeTopic, "handler", "payments.charge"))
	dead := count(`SELECT count(*) FROM pgsaga_dead_letters`)
	assert.Equal(t, float64(1), dead)
	assert.Equal(t, dead, value(fams, "pgsaga_dead_letters_total", "topic", payments.ChargeTopic, "handler", "payments.charge"))
	assert.Equal(t, dead, value(fams, "pgsaga_dead_letters_waiting", "topic", payments.ChargeTopic))
	assert.Zero(t, value(fams, "pgsaga_consumer_depth"), "every queue drained")
	groups := count(`SELECT count(*) FROM pgsaga_subscriptions`)
	assert.Equal(t, groups, float64(len(fams["pgsaga_consumer_depth"].GetMetric())), "a depth for every consumer group")
}

// Starting a saga in Place's transaction whose first command cannot be
// queued rolls the start back and queues the trigger instead: the saga is
// told started once, by the worker that starts it.
func TestStartRolledBackInPlaceIsToldOnce(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	logs := &records{}
	e := newEnv(t, 0, func(c *orderpayment.Config) { c.Transport.Metrics = reg; c.Logger = slog.New(logs) })
	_, err := e.db.SQL.Exec(`
CREATE SEQUENCE charge_inserts;
CREATE FUNCTION fail_first_charge() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.topic = 'payments.charge' AND nextval('charge_inserts') = 1 THEN
        RAISE EXCEPTION 'the first charge cannot be queued';
    END IF;
    RETURN NEW;
END$$;
CREATE TRIGGER fail_first_charge BEFORE INSERT ON pgsaga_queue FOR EACH ROW EXECUTE FUNCTION fail_first_charge()`)
	require.NoError(t, err)
	_, id := e.place(e.customer(100_000), 1_000)
	e.startWorker()
	e.terminal(id)
	// Its end is told after its start.
	deadline := time.Now().Add(10 * time.Second)
	for logs.count("saga completed", "saga_id", id.String()) == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	require.Equal(t, 1, logs.count("saga completed", "saga_id", id.String()))
	var chargeInserts int
	require.NoError(t, e.db.SQL.QueryRow(`SELECT nextval('charge_inserts') - 1`).Scan(&chargeInserts))
	require.Equal(t, 2, chargeInserts, "the first charge was refused, the second queued")
	assert.Equal(t, 1, logs.count("saga started", "saga_id", id.String()))
	fams, err := reg.Gather()
	require.NoError(t, err)
	byName := map[string]*dto.MetricFamily{}
	for _, f := range fams {
		byName[f.GetName()] = f
	}
	assert.Equal(t, 1.0, value(byName, "pgsaga_sagas_started_total"))
}

// An operator's cancel runs in a transaction the engine opens: it is told
// once that commits, and not at all when the commit fails.
func TestOperatorCancelIsToldOnCommit(t *testing.T) {
	t.Parallel()
	logs := &records{}
	e := newEnv(t, 0, func(c *orderpayment.Config) { c.Logger = slog.New(logs) })
	_, id := e.place(e.customer(100_000), 1_000) // started in Place's transaction; no worker runs
	_, err := e.db.SQL.Exec(`
CREATE TABLE cancel_trap (armed bool);
INSERT INTO cancel_trap VALUES (true);
CREATE FUNCTION cancel_trap() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (SELECT armed FROM cancel_trap) THEN
        RAISE EXCEPTION 'the commit fails';
    END IF;
    RETURN NULL;
END$$;
CREATE CONSTRAINT TRIGGER cancel_trap AFTER UPDATE ON saga_instances DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION cancel_trap()`)
	require.NoError(t, err)
	err = e.app.Client.Cancel(context.Background(), id, "test")
	require.ErrorContains(t, err, "the commit fails")
	inst, err := e.app.Client.Get(context.Background(), id)
	require.NoError(t, err)
	require.Equal(t, saga.StatusRunning, inst.Status, "nothing of the cancel committed")
	assert.Zero(t, logs.count("saga compensating", "saga_id", id.String()), "nor was it told")

	_, err = e.db.SQL.Exec(`UPDATE cancel_trap SET armed = false`)
	require.NoError(t, err)
	require.NoError(t, e.app.Client.Cancel(context.Background(), id, "test"))
	assert.Equal(t, 1, logs.count("saga compensating", "saga_id", id.String()), "told once it committed")
}

// drained waits until no queue holds a message.
func (e *env) drained() {
	e.t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		var n int
		require.NoError(e.t, e.db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_queue`).Scan(&n))
		if n == 0 {
			return
		}
		if time.Now().After(deadline) {
			var left []string
			rows, err := e.db.SQL.Query(`SELECT topic || '/' || consumer_group || ' attempts ' || attempts FROM pgsaga_queue`)
			require.NoError(e.t, err)
			for rows.Next() {
				var s string
				require.NoError(e.t, rows.Scan(&s))
				left = append(left, s)
			}
			rows.Close()
			sort.Strings(left)
			e.t.Fatalf("queues not drained: %s", fmt.Sprint(left))
		}
		time.Sleep(20 * time.Millisecond)
	}
}
