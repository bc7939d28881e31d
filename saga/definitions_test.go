package saga_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/steps"
)

// Two live processes with different step lists under one saga version (a
// rolling deploy of a definition changed without a new Version, while no
// instance was unfinished, so both passed RecordDefinitions): each drives
// only the instances started with its own steps. The other's are left
// alone and reported, never misread (the new process read the old one's
// step 0 as pay, and paid before anything was booked).
func TestTwoLiveProcessesWithDifferentStepsOfOneVersion(t *testing.T) {
	t.Parallel()
	e := newEnv(t, options{deadline: time.Hour, silent: []string{"book"}})
	ctx := context.Background()
	require.NoError(t, e.engine.RecordDefinitions(ctx)) // the old process: [book pay]

	// The new process: the same name and version, the steps swapped.
	cmd := func(op string) *saga.Command[tripData] {
		return saga.Send(steps.Define[tripCmd](op, e.topics[op], nil), func(d tripData) tripCmd { return tripCmd{Trip: d.Trip, Op: op} })
	}
	swapped := saga.MustDefine(saga.Spec[tripData]{
		Name:    e.def.Name,
		Trigger: saga.On(e.def.Trigger, func(started) (string, tripData, error) { return "", tripData{}, errors.New("unused") }),
		Steps: []saga.Step[tripData]{
			{Name: "pay", Action: cmd("pay"), Compensation: cmd("refund"), Deadline: time.Hour},
			{Name: "book", Action: cmd("book"), Compensation: cmd("cancel"), Deadline: time.Hour},
		},
	})
	require.NotEqual(t, e.def.Fingerprint(), swapped.Fingerprint())
	other, err := saga.NewEngine(saga.Config{DB: e.db.SQL, Transport: e.tr, Logger: logger()})
	require.NoError(t, err)
	require.NoError(t, other.Register(swapped))
	require.NoError(t, other.RecordDefinitions(ctx), "no instance of the version is unfinished yet")

	// The old process still runs and starts instances with [book pay].
	id := e.start("bern")
	e.wait(id, "book in flight", func(i saga.Instance) bool { return i.Step == "book" })
	e.waitConsumed(e.topics["book"], "participant-book-"+e.id)
	e.overdue(id)
	res, err := other.Sweep(ctx)
	require.NoError(t, err)
	assert.Equal(t, saga.SweepResult{}, res, "the new process leaves the old one's instance alone")
	var paid int
	require.NoError(t, e.db.SQL.QueryRow(`SELECT count(*) FROM `+archived(e.topics["pay"])+` WHERE metadata->>'saga_id' = $1`, id.String()).Scan(&paid))
	assert.Zero(t, paid, "no pay command for an instance still booking")
	unknown, err := other.UnknownDefinitions(ctx)
	require.NoError(t, err)
	assert.Contains(t, unknown, saga.UnknownDefinition{Name: e.def.Name, Version: 1, Instances: 1, OtherSteps: true})
	assert.ErrorIs(t, other.Retry(ctx, id), saga.ErrUnknownDefinition)

	// The old process drives it as it started.
	assert.Equal(t, saga.SweepResult{Resent: 1}, e.sweep())
}
