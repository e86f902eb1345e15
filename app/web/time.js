/** "3 minutes ago" and the like, in the reader's language, for the conversation list. */

const relativeTime = new Intl.RelativeTimeFormat(undefined, { numeric: "auto" });
export function describeTime(iso) {
  const then = Date.parse(iso);
  if (Number.isNaN(then)) return "";
  const seconds = Math.round((then - Date.now()) / 1000);
  const steps = [
    [60, "second"],
    [60, "minute"],
    [24, "hour"],
    [7, "day"],
    [Infinity, "week"],
  ];
  let value = seconds;
  for (const [size, unit] of steps) {
    if (Math.abs(value) < size) return relativeTime.format(value, unit);
    value = Math.round(value / size);
  }
  return "";
}
