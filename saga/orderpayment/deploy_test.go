package orderpayment_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/orders"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
)

// A rolling deploy of a new definition version costs no saga. Two
// processes on one database, one serving version 1, the other the new
// release (versions 1 and 2, or 2 alone), each starting sagas of its
// newest version while the other's run: every reply or request a process
// gets for a version it does not know is handed back, no attempt spent,
// and the process that knows it handles it. 300 sagas: none
// dead-lettered, none compensated, nothing refunded, every invariant
// holds. (Before, such a reply was dead-lettered as permanent, and sagas
// whose charge had succeeded were refunded.)
func TestARollingDeployCostsNoSaga(t *testing.T) {
	t.Parallel()
	const early = 3 // sagas of the new version placed before its worker starts
	for _, c := range []struct {
		name string
		also []int // versions the new release still serves besides 2
	}{
		{"the new release serves versions 1 and 2", []int{1}},
		{"the new release serves version 2 alone", nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			oldMetrics, newMetrics := prometheus.NewRegistry(), prometheus.NewRegistry()
			e := newEnv(t, 1, func(cfg *orderpayment.Config) { cfg.Transport.Metrics = oldMetrics })
			cfg := e.cfg
			cfg.DB = testdb.Open(t, e.db.URL, 10).SQL // a process of its own: its own pool
			cfg.Version, cfg.Transport.Metrics = 2, newMetrics
			next, err := orderpayment.New(cfg)
			require.NoError(t, err)
			for _, v := range c.also {
				spec := orderpayment.Spec(orderpayment.Steps(cfg.Timeouts))
				spec.Version = v
				require.NoError(t, next.Client.Register(saga.MustDefine(spec)))
			}
			require.NoError(t, next.Setup(context.Background()))
			customer := e.customer(1_000_000_000)
			var (
				mu  sync.Mutex
				ids []uuid.UUID
				wg  sync.WaitGroup
			)
			// The case under test, made to happen: sagas of the new
			// version while only the old release works, whose replies
			// only the new release can take.
			for range early {
				res, err := next.Orders.Place(context.Background(), orders.PlaceRequest{Key: uuid.NewString(), CustomerID: customer, AmountCents: 1_000})
				require.NoError(t, err)
				ids = append(ids, saga.ID(orderpayment.Name, res.OrderID.String()))
			}
			require.Eventually(t, func() bool { return counterSum(t, oldMetrics, "pgsaga_delivery_handed_back_total") > 0 },
				30*time.Second, 5*time.Millisecond, "the old release hands back the new version's replies")
			w, err := next.NewWorker()
			require.NoError(t, err)
			require.NoError(t, w.Start(context.Background()))
			t.Cleanup(func() { _ = w.Stop() })

			for g, svc := range []*orders.Service{e.app.Orders, next.Orders, e.app.Orders, next.Orders} {
				wg.Go(func() {
					for range 75 {
						res, err := svc.Place(context.Background(), orders.PlaceRequest{Key: uuid.NewString(), CustomerID: customer, AmountCents: 1_000})
						if !assert.NoError(t, err, "placer %d", g) {
							return
						}
						mu.Lock()
						ids = append(ids, saga.ID(orderpayment.Name, res.OrderID.String()))
						mu.Unlock()
					}
				})
			}
			wg.Wait()
			require.Len(t, ids, 300+early)
			versions := map[int]int{}
			for _, id := range ids {
				inst := e.terminal(id)
				assert.Equal(t, saga.StatusCompleted, inst.Status, "saga %s (version %d): %s", id, inst.DefinitionVersion, inst.FailureReason)
				versions[inst.DefinitionVersion]++
			}
			assert.Equal(t, map[int]int{1: 150, 2: 150 + early}, versions, "each process started sagas of its newest version")
			r := e.checkInvariants(ids)
			assert.Equal(t, 300+early, r.Sagas[saga.StatusCompleted])
			var dead int
			require.NoError(t, e.db.SQL.QueryRow(`SELECT count(*) FROM pgsaga_dead_letters`).Scan(&dead))
			assert.Zero(t, dead, "nothing dead-lettered")
			stats, err := e.gw.Stats(context.Background())
			require.NoError(t, err)
			assert.Equal(t, 300+early, stats.Charges)
			assert.Zero(t, stats.Refunds, "no charge refunded")
			handedBack := counterSum(t, oldMetrics, "pgsaga_delivery_handed_back_total")
			if c.also == nil {
				handedBack += counterSum(t, newMetrics, "pgsaga_delivery_handed_back_total")
			}
			assert.Positive(t, handedBack, "replies of the other release's sagas were handed back (the case under test happened)")
		})
	}
}

// counterSum sums the counter name over its labels in reg.
func counterSum(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	require.NoError(t, err)
	var sum float64
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			sum += m.GetCounter().GetValue()
		}
	}
	return sum
}
